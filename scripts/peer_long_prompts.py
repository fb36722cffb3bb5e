"""The long-prompt workload on mini-SGLang, beside minisrv's (run on the GPU machine through the peers' runner:
`bash .peers/run.sh minisgl /tmp/qwen3 scripts/peer_long_prompts.py`, ../shared/peers/). The requests are
bench_offline.py's `--num-prompts 16 --min-input-len 16384 --max-input-len 30720 --min-output-len 128
--max-output-len 256` (its nano workload's draw: random.seed(0), the prompts, then the output lengths; temperature
0.6, ignore_eos), so both engines get the same prompts; one short warm-up generate first; the clock covers one
generate call."""
import random
import sys
import time

NUM, IN_RANGE, OUT_RANGE = 16, (16384, 30720), (128, 256)


def main() -> None:
    peer, path = sys.argv[1], sys.argv[2]
    if peer != "minisgl":
        raise SystemExit("only minisgl takes this workload here")
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(*IN_RANGE))] for _ in range(NUM)]
    outs = [random.randint(*OUT_RANGE) for _ in range(NUM)]
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM
    llm = LLM(path, max_seq_len_override=IN_RANGE[1] + OUT_RANGE[1] + 16, max_extend_tokens=16384,
              cuda_graph_max_bs=256, page_size=256)
    llm.generate(["Benchmark: "], SamplingParams(temperature=0.1))
    t = time.time()
    llm.generate(prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o) for o in outs])
    t = time.time() - t
    print(f"RESULT peer={peer} total={sum(outs)}tok time={t:.2f}s throughput={sum(outs) / t:.1f}tok/s")


if __name__ == "__main__":
    main()
