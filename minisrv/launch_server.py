"""`python -m minisrv.launch_server [flags]`: the OpenAI-compatible server (see minisrv.server.launch_server)."""

if __name__ == "__main__":  # the engine process re-imports this module under spawn: it must not start a server
    from minisrv.server.launch_server import main

    main()
