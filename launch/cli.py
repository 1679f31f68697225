"""The `pagoda` command.

    pagoda serve [flags]                       the whole stack, as `make run` (python -m launch)
    pagoda generate PROMPT [--chat] [--max-tokens N] [--stream] [--temperature T] [--target HOST:PORT]
                                               one request against a running server, over gRPC
    pagoda bench serve [flags]                 bench/serve.py (online: rates, TTFT, TPOT, ITL)
    pagoda bench offline [flags]               bench/offline.py (against transformers)

`pagoda <command> --help` lists each one's flags with their defaults.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from launch.children import ROOT
from process_life.flag_types import COUNT, POSITIVE_SECONDS, float_at_least

BENCHES = {"serve": "bench.serve", "offline": "bench.offline"}  # run as modules from the root


def generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagoda generate", description="one request to a running pagoda",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    p.add_argument("--max-tokens", type=COUNT, default=256)
    p.add_argument("--temperature", type=float_at_least(0.0), default=0.0)
    p.add_argument("--stream", action="store_true", help="print the text as it arrives")
    p.add_argument("--target", default="127.0.0.1:50051", help="the gateway's gRPC address")
    p.add_argument("--timeout", type=POSITIVE_SECONDS, default=600.0, help="seconds before DEADLINE_EXCEEDED")
    args = p.parse_args(argv)

    import grpc

    from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
    request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=args.temperature),
                                 stopping=pb.StoppingCriteria(max_tokens=args.max_tokens))
    if args.chat:
        request.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    with grpc.insecure_channel(args.target) as channel:
        stub = pagoda_pb2_grpc.GenerationStub(channel)
        try:
            if args.stream:
                last = None
                for last in stub.GenerateStream(request, timeout=args.timeout):
                    print(last.text, end="", flush=True)
                print()
            else:
                last = stub.Generate(request, timeout=args.timeout)
                print(last.text)
        except grpc.RpcError as e:
            print(f"pagoda generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if last is not None:
        print(f"[{pb.FinishReason.Name(last.finish_reason)}, {last.usage.prompt_tokens} prompt + "
              f"{last.usage.completion_tokens} output tokens]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("--help", [])
    if command == "serve":
        from launch.flag_routing import process_parsers
        from launch.stack import main as serve
        if {"-h", "--help"} & set(rest):
            print("usage: pagoda serve [--num-workers N] [flags]\n\nA scheduler, N workers (default "
                  "1) and a gateway; each flag goes to every process that knows it.")
            for name, parser in process_parsers().items():
                # Defaults shown for every flag (those whose help names it already keep theirs).
                parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
                print(f"\n{name} flags:\n" + parser.format_help().split("\n", 1)[1])
            return 0
        return serve(rest)
    if command == "generate":
        return generate(rest)
    if command == "bench" and rest and rest[0] in BENCHES:
        return subprocess.call([sys.executable, "-m", BENCHES[rest[0]], *rest[1:]], cwd=ROOT)
    print(__doc__, file=sys.stdout if command in ("-h", "--help") else sys.stderr)
    return 0 if command in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
