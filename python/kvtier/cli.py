"""The ``kvtier`` command: ``demo``, ``generate``, ``chat``, ``top``, ``bench layout|store|ssd|remote|sim|codec|engine|transfer|vllm|sglang|peers`` and ``sim``. ``--json`` prints one JSON object.
A user error (a bad value, a missing or unusable file or directory) is one line
``kvtier: error: ...`` on stderr and exit status 2; Ctrl-C is ``kvtier: interrupted`` and status 130
(an output file is written whole or not at all); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from kvtier import report
from kvtier.config import parse_size
from kvtier.errors import KvtierError, os_error_message
from kvtier.remote import check_url
from kvtier.results import emit as _emit
from kvtier.results import json_text, write_json
from kvtier.results import output_directory as _directory
from kvtier.results import output_file as _output_file
from kvtier.sim import compiled
from kvtier.sim import size as sim_size


def _demo(args: argparse.Namespace) -> None:
    from kvtier import demo

    if args.engine:
        from kvtier.engine import replay

        replayed = replay.run(
            conversations=args.conversations,
            turns=args.turns,
            ssd_directory=_directory(args.ssd_dir, "--ssd-dir"),
            show=not args.json,
        )
        _emit(replayed, args.json, replay.summary)
        return
    result = demo.run(
        conversations=args.conversations,
        turns=args.turns,
        dram_capacity=parse_size(args.dram_capacity, "--dram-capacity"),
        seed=args.seed,
        show=not args.json,
    )
    _emit(result, args.json, demo.summary)


def _bench_layout(args: argparse.Namespace) -> None:
    from kvtier.bench import layout

    result = layout.run(tokens=args.tokens, repeats=args.repeats, threads=args.threads, show=not args.json)
    _emit(result, args.json, layout.summary)


def _bench_store(args: argparse.Namespace) -> None:
    from kvtier.bench import store

    result = store.run(
        total_bytes=parse_size(args.total, "--total"),
        repeats=args.repeats,
        lookup_tokens=args.lookup_tokens,
        threads=args.threads,
        show=not args.json,
    )
    _emit(result, args.json, store.summary)


def _sim_run(args: argparse.Namespace) -> None:
    from kvtier.sim.run import run

    out = _output_file(args.out, "--out")
    config = sim_size.source_config(args.config, args.policy, args.engines)
    tree = compiled.fresh_tree(args.build)
    if tree is not None and compiled.running_build() == "python":  # the same command on the copy
        print(f"kvtier: replaying on the compiled simulator ({tree})", file=sys.stderr)
        # The command as given, every flag with it; the last --build wins (argparse), so the child runs here.
        cmd = [sys.executable, "-m", "kvtier.cli", *args.argv, "--build", "python"]
        done = subprocess.run(cmd, env=compiled.child_env(tree), check=False)
        if done.returncode != 0:  # it said why on stderr
            raise SystemExit(done.returncode)
        return
    result = run(config, show_progress=True)  # on stderr, to a terminal only: --json too
    _write(out, result)
    _emit(result, args.json, report.sim_summary)


def _sim_sweep(args: argparse.Namespace) -> None:
    from kvtier.sched.base import check_policy_names
    from kvtier.sim import plots
    from kvtier.sim.run import RateRun, SweepResult, sweep

    config = sim_size.source_config(args.config)  # a trace too: its workload names why it has no rate
    rates = _floats(args.rates, "--rates")
    policies = args.policies.split(",") if args.policies else [str(config.policy["name"])]
    check_policy_names(policies)  # every one before the first replay
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)  # before the sweep: a bad --out-dir fails at once
    _output_file(str(out_dir / "sweep.json"), "--out-dir")  # so does one the system will not write in
    series: dict[str, list[RateRun]] = {}
    for name in policies:
        policy = {**config.policy, "name": name} if name == config.policy["name"] else {"name": name}
        series[name] = sweep(config.with_overrides(policy=policy), rates, show_progress=True)
    figures = [
        str(plots.latency_vs_rate(series, out_dir / "latency_vs_rate.png")),
        str(plots.throughput_vs_ttft(series, out_dir / "throughput_vs_ttft.png")),
    ]
    result: SweepResult = {"config": config.name, "rates_per_s": rates, "series": series, "plots": figures}
    _write(str(out_dir / "sweep.json"), result)
    _emit(result, args.json, report.sweep_summary)


def _sim_calibrate(args: argparse.Namespace) -> None:
    from kvtier.bench import vllm_sim
    from kvtier.engine import calibrate

    def show(done: int, total: int) -> None:
        if sys.stderr.isatty():
            sys.stderr.write(f"\rcalibrate: measured {done}/{total} engine step shapes")
            sys.stderr.write("\n" if done == total else "")
            sys.stderr.flush()

    if args.engine == "vllm":  # vLLM's steps, timed in its environment
        result = vllm_sim.calibrate_command(args)
    else:
        result = calibrate.calibrate(
            quick=args.quick, repeats=args.repeats, threads=args.threads, progress=show
        )
    calibrate.write(result, Path(args.out))
    result["written_to"] = args.out
    _emit(result, args.json, calibrate.summary)


def _sim_reproduce(args: argparse.Namespace) -> None:
    from kvtier.sim import reproduce

    names = reproduce.papers() if args.all else [args.paper]
    if not args.all and not args.paper:
        raise KvtierError(f"name a paper or pass --all; papers: {reproduce.papers()}")
    rows: list[reproduce.RowJson] = []
    for name in names:
        rows.extend(row.to_dict() for row in reproduce.run(name, Path(args.out_dir) / name, quick=args.quick))
    _write(str(Path(args.out_dir) / "rows.json"), {"rows": rows})  # for `kvtier report`
    if args.json:
        print(json_text(rows, sort_keys=True))
        return
    print(f"{'paper':14s} {'metric':58s} {'paper':>13s} {'kvtier':>8s}  within 30%")
    for r in rows:
        paper_value = (
            f"{r['paper_ratio']:.2f}"
            if r["paper_ratio"] is not None
            else (f"{r['paper_range'][0]:.2f}-{r['paper_range'][1]:.2f}" if r["paper_range"] else "-")
        )
        within = "n/a" if r["within_30_percent"] is None else r["within_30_percent"]  # no paper number
        print(f"{r['paper']:14s} {r['metric']:58s} {paper_value:>13s} {r['kvtier_ratio']:8.2f}  {within}")
        if r["note"]:
            print(f"{'':14s}   note: {r['note']}")


def _bench_ssd(args: argparse.Namespace) -> None:
    from kvtier.bench import ssd

    result = ssd.run(
        directory=_directory(args.directory, "--directory"),
        total_bytes=parse_size(args.total, "--total"),
        small_count=args.small_count,
        large_count=args.large_count,
        stripe_count=args.stripe_count,
        recovery_objects=args.recovery_objects,
        repeats=args.repeats,
        io_depth=args.io_depth,
        io_engine=args.io_engine,
        show=not args.json,
    )
    _emit(result, args.json, ssd.summary)


def _bench_remote(args: argparse.Namespace) -> None:
    from kvtier.bench import remote

    if args.url is not None:
        check_url(args.url, "--url")
    for url in args.cluster_url or ():
        check_url(url, "--cluster-url")
    result = remote.run(
        url=args.url,
        cluster_urls=args.cluster_url or None,
        cluster=not args.no_cluster,
        object_bytes=parse_size(args.object_bytes, "--object-bytes"),
        objects=args.objects,
        batch=args.batch,
        repeats=args.repeats,
    )
    _emit(result, args.json, remote.summary)


def _bench_transfer(args: argparse.Namespace) -> None:
    from kvtier.bench import transfer

    result = transfer.run(
        total_bytes=parse_size(args.total, "--total"),
        repeats=args.repeats,
        threads=args.threads,
        swap_blocks=args.swap_blocks,
        directory=_directory(args.directory, "--directory"),
        show=not args.json,
        cuda_device=transfer.cuda_device(args.device),
    )
    _emit(result, args.json, transfer.summary)


def _bench_codec(args: argparse.Namespace) -> None:
    from kvtier.bench import codec

    result = codec.run(
        repeats=args.repeats, threads=args.threads, show=not args.json, agreement=not args.no_agreement
    )
    _emit(result, args.json, codec.summary)


def _bench_engine(args: argparse.Namespace) -> None:
    from kvtier.bench import engine

    result = engine.run(
        prefix_tokens=args.prefix_tokens,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        threads=args.threads,
        directory=_directory(args.directory, "--directory"),
        show=not args.json,
        calibration=args.calibration,
    )
    _emit(result, args.json, engine.summary)


def _write(path: str | None, result: Mapping[str, object]) -> None:
    if path:
        write_json(path, result)  # whole or not at all: never a cut-off result


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise KvtierError(f"{what} is {text!r}; expected comma-separated numbers such as 0.5,1,2") from None
    if not values or any(not v > 0 for v in values):
        raise KvtierError(f"{what} is {text!r}; expected positive request rates")
    return values


def _whole(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not >= {minimum}")
        return value

    return parse


_positive, _non_negative = _whole(1), _whole(0)


_JSON_HELP, _REPEATS_HELP = "print one JSON object instead of the summary", "rounds; the median is reported"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line ``kvtier: error: ...`` (exit status 2), like every other user
    error, naming the subcommand and where its help is. Subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("kvtier").strip()
        self.exit(
            2, f"kvtier: error: {command + ': ' if command else ''}{message} (see {self.prog} --help)\n"
        )


def build_parser() -> argparse.ArgumentParser:
    from kvtier import top
    from kvtier.bench import peers as bench_peers
    from kvtier.bench import sglang as bench_sglang
    from kvtier.bench import sim as bench_sim
    from kvtier.bench import vllm as bench_vllm
    from kvtier.bench import vllm_sim
    from kvtier.engine.cli import add_commands as add_engine_commands

    parser = _Parser(prog="kvtier", description="Hierarchical KV-cache layer for LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="multi-turn conversations through the store (embedded defaults)")
    demo.add_argument("--conversations", type=_positive, default=3, help="conversations (default 3)")
    demo.add_argument("--turns", type=_positive, default=6, help="turns per conversation (default 6)")
    demo.add_argument("--dram-capacity", default="2GiB", help="DRAM tier capacity (default 2GiB)")
    demo.add_argument("--seed", type=_non_negative, default=0, help="random seed of the chats (default 0)")
    demo.add_argument(
        "--engine",
        action="store_true",
        help="replay the chats on the SmolLM2 reference engine: TTFT per tier (recompute, DRAM, SSD)",
    )
    demo.add_argument("--ssd-dir", default=None, help="--engine: SSD tier directory (default: a temp dir)")
    demo.add_argument("--json", action="store_true", help=_JSON_HELP)
    demo.set_defaults(func=_demo)

    add_engine_commands(sub, _positive)  # generate, chat
    top.add_command(sub)
    report.add_command(sub)

    bench = sub.add_parser(
        "bench", help="benchmarks; each reports ratios to a limit measured in the same run"
    )
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    layout = bench_sub.add_parser("layout", help="gather/scatter vs memcpy and vs per-segment copies")
    layout.add_argument("--tokens", type=_positive, default=8192, help="tokens copied (default 8192)")
    layout.add_argument("--repeats", type=_positive, default=5, help=_REPEATS_HELP)
    layout.add_argument("--threads", type=_non_negative, default=0, help="copy workers (0 = one per core)")
    layout.add_argument("--json", action="store_true", help=_JSON_HELP)
    layout.set_defaults(func=_bench_layout)
    store = bench_sub.add_parser("store", help="DRAM-tier put/get vs memcpy; 128K-token lookup")
    store.add_argument("--total", default="1GiB", help="bytes per round of 2 MiB objects (default 1GiB)")
    store.add_argument("--repeats", type=_positive, default=5, help=_REPEATS_HELP)
    store.add_argument("--lookup-tokens", type=_positive, default=131072, help="prefix looked up")
    store.add_argument("--threads", type=_non_negative, default=0, help="copy workers (0 = one per core)")
    store.add_argument("--json", action="store_true", help=_JSON_HELP)
    store.set_defaults(func=_bench_store)
    bssd = bench_sub.add_parser(
        "ssd", help="SSD pool vs raw O_DIRECT device loop and file-per-object; striping; recovery"
    )
    bssd.add_argument(
        "--directory", default=None, help="where pool and baseline files go (default: temp dir)"
    )
    bssd.add_argument("--total", default="1GiB", help="bytes of 2 MiB objects for the raw-device ratios")
    bssd.add_argument(
        "--small-count", type=_positive, default=2048, help="256 KiB objects vs file per object"
    )
    bssd.add_argument("--large-count", type=_positive, default=256, help="2 MiB objects vs file per object")
    bssd.add_argument("--stripe-count", type=_positive, default=128, help="2 MiB objects for striping")
    bssd.add_argument("--recovery-objects", type=_positive, default=100_000, help="objects the pool reopens")
    bssd.add_argument("--repeats", type=_positive, default=3, help=_REPEATS_HELP)
    bssd.add_argument("--io-depth", type=_positive, default=8, help="reads in flight (default 8)")
    bssd.add_argument("--io-engine", choices=["auto", "io_uring", "pread"], default="auto", help="I/O")
    bssd.add_argument("--json", action="store_true", help=_JSON_HELP)
    bssd.set_defaults(func=_bench_ssd)
    bremote = bench_sub.add_parser(
        "remote", help="remote tier (Redis/Valkey) vs a raw Redis client; single server and 3-master cluster"
    )
    bremote.add_argument("--url", help="server URL (default: start a loopback redis-server)")
    bremote.add_argument("--cluster-url", action="append", help="cluster seed URL (default: start 3 masters)")
    bremote.add_argument("--no-cluster", action="store_true", help="skip the cluster figures")
    bremote.add_argument("--object-bytes", default="4MiB", help="size of each object (default 4MiB)")
    bremote.add_argument("--objects", type=_positive, default=32, help="objects per round (default 32)")
    bremote.add_argument("--batch", type=_positive, default=16, help="objects per pipelined call")
    bremote.add_argument("--repeats", type=_positive, default=7, help=_REPEATS_HELP)
    bremote.add_argument("--json", action="store_true", help=_JSON_HELP)
    bremote.set_defaults(func=_bench_remote)
    bengine = bench_sub.add_parser(
        "engine", help="reference engine: prefill/decode tokens/s; TTFT of a cached 2K prefix per tier"
    )
    bengine.add_argument("--prefix-tokens", type=_positive, default=2048, help="cached prefix (default 2048)")
    bengine.add_argument("--new-tokens", type=_positive, default=32, help="tokens decoded (default 32)")
    bengine.add_argument("--repeats", type=_positive, default=2, help=_REPEATS_HELP)
    bengine.add_argument("--threads", type=_positive, default=1, help="BLAS threads (default 1)")
    bengine.add_argument("--directory", default=None, help="SSD tier directory (default: a temp dir)")
    bengine.add_argument(
        "--calibration", default="cpu-smollm2-135m", help="packaged name or `sim calibrate` YAML"
    )
    bengine.add_argument("--json", action="store_true", help=_JSON_HELP)
    bengine.set_defaults(func=_bench_engine)
    bcodec = bench_sub.add_parser(
        "codec", help="codec ratios, per-core decode/encode Gbit/s and quant error on the real KV fixture"
    )
    bcodec.add_argument("--repeats", type=_positive, default=3, help=_REPEATS_HELP)
    bcodec.add_argument(
        "--threads", type=_non_negative, default=0, help="threads for the all-cores figure (0 = one per core)"
    )
    bcodec.add_argument(
        "--no-agreement", action="store_true", help="skip the next-token agreement run on the real model"
    )
    bcodec.add_argument("--json", action="store_true", help=_JSON_HELP)
    bcodec.set_defaults(func=_bench_codec)
    btransfer = bench_sub.add_parser(
        "transfer",
        help="transfer engine: pipelined vs sequential SSD load, per-chunk allocation, batched and duplex swaps",
    )
    btransfer.add_argument("--total", default="64MiB", help="bytes the pipelined load moves (default 64MiB)")
    btransfer.add_argument("--repeats", type=_positive, default=5, help=_REPEATS_HELP)
    btransfer.add_argument(
        "--threads", type=_non_negative, default=0, help="threads split among stages (0 = one per core)"
    )
    btransfer.add_argument(
        "--swap-blocks", type=_positive, default=16, help="4 MiB blocks per swap direction"
    )
    btransfer.add_argument("--directory", default=None, help="where the SSD tier's temp dir goes")
    btransfer.add_argument("--device", default="host", help="duplex device pool: host or cuda:N")
    btransfer.add_argument("--json", action="store_true", help=_JSON_HELP)
    btransfer.set_defaults(func=_bench_transfer)
    for bench_module in (
        bench_sim,
        bench_vllm,
        bench_sglang,
        bench_peers,
    ):  # subcommands that register themselves
        bench_module.add_command(bench_sub, _positive, _emit)

    sim = sub.add_parser("sim", help="discrete-event serving simulator")
    sim_sub = sim.add_subparsers(dest="sim", required=True)
    sim_run = sim_sub.add_parser("run", help="run one simulation config (YAML) or trace")
    sim_run.add_argument("config", help="a sim config (YAML path or bundled name) or a .jsonl/.csv trace")
    sim_run.add_argument("--engines", type=_positive, help="colocated engines (default: the config's, 1)")
    sim_run.add_argument("--policy", default=None, help="policy for a trace (default hicache)")
    sim_run.add_argument("--out", default=None, help="write the result JSON here")
    compiled.add_build_argument(sim_run, "python")
    sim_run.add_argument("--json", action="store_true", help=_JSON_HELP)
    sim_run.set_defaults(func=_sim_run)
    sim_size.add_command(sim_sub, _emit)
    compiled.add_command(sim_sub)
    sim_sweep = sim_sub.add_parser("sweep", help="run a config over request rates and policies; plot")
    sim_sweep.add_argument("config", help="a sim config (YAML path or bundled name)")
    sim_sweep.add_argument("--rates", required=True, help="comma-separated request rates, e.g. 0.5,1,2")
    sim_sweep.add_argument(
        "--policies", default=None, help="comma-separated policy names (default: the config's)"
    )
    sim_sweep.add_argument("--out-dir", default="sim-out", help="where plots and sweep.json go")
    sim_sweep.add_argument("--json", action="store_true", help=_JSON_HELP)
    sim_sweep.set_defaults(func=_sim_sweep)
    sim_cal = sim_sub.add_parser("calibrate", help="fit the simulator's step-time model to an engine's steps")
    sim_cal.add_argument("--quick", action="store_true", help="small shapes only (tests)")
    sim_cal.add_argument("--repeats", type=_positive, default=3, help="best of N runs per shape")
    sim_cal.add_argument("--threads", type=_positive, default=1, help="BLAS threads of the engine")
    sim_cal.add_argument("--out", default="sim-out/calibration/cpu-smollm2-135m.yaml", help="YAML to write")
    vllm_sim.add_calibrate_arguments(sim_cal)  # --engine reference|vllm, --venv
    sim_cal.add_argument("--json", action="store_true", help=_JSON_HELP)
    sim_cal.set_defaults(func=_sim_calibrate)
    sim_rep = sim_sub.add_parser("reproduce", help="reproduce the papers' headline experiments")
    sim_rep.add_argument("paper", nargs="?", default=None, help="paper name (see --all)")
    sim_rep.add_argument("--all", action="store_true", help="every paper")
    sim_rep.add_argument("--quick", action="store_true", help="smaller workloads (tests)")
    sim_rep.add_argument("--out-dir", default="sim-out/reproduce", help="plots go here")
    sim_rep.add_argument("--json", action="store_true", help=_JSON_HELP)
    sim_rep.set_defaults(func=_sim_reproduce)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Python hides DeprecationWarnings outside __main__: show kvtier's (old keys, policy names).
    warnings.filterwarnings("default", category=DeprecationWarning, module="kvtier")
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a command re-runs elsewhere
    try:
        args.func(args)
    except KvtierError as e:
        message = str(e)
    except BrokenPipeError as e:  # stdout's reader left (`| head`): SIGPIPE's status, nothing to say
        if _stdout_gone():
            return 141
        message = os_error_message(e)  # a socket's pipe: the user's server went away
    except OSError as e:
        # A file or directory named on the command line (or in a config) that the system refused:
        # the user's to fix, not a bug. Other exceptions keep their traceback.
        message = os_error_message(e)
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for SIGINT; outputs are whole or absent
        print("kvtier: interrupted", file=sys.stderr)
        return 130
    else:
        return 0
    print(f"kvtier: error: {message}", file=sys.stderr)
    return 2


def _stdout_gone() -> bool:
    """Whether stdout is a pipe with no reader left (poll's POLLERR); if so it is pointed at
    /dev/null, so that Python's flush at exit does not fail again."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or no stdout file
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return gone


if __name__ == "__main__":
    raise SystemExit(main())
