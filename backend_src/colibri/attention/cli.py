"""`python -m colibri generate`: one greedy generation through the attention tier, its tokens and
timings written as JSON ({"tokens": [...], "ttft_ms": ..., "tpot_ms": ...})."""
import argparse
import json
import pathlib
import sys

from colibri._native import ColibriError

DESCRIPTION = (
    "Generates greedily from a prompt of token ids with a Hugging Face MoE model, whose own non-expert parts "
    "(embeddings, attention with a KV cache, norms, dense layers, lm_head) run with transformers on this host "
    "while every MoE block is computed by Colibri's expert tier, a server started with `python -m colibri serve "
    "--weights PACKED_DIR` (over gRPC, or CUDA shared memory on the same host) or the packed layers in-process. "
    "No expert weight of the model is read. Needs torch and transformers.")
EPILOG = (
    "TTFT is the time from the prompt's ids in to its first new token out (the prefill through every layer), "
    "TPOT the mean time of each later token; the device is synchronised before each clock is read, after one "
    "untimed warm-up run of the same prompt (--warmup). PACKED_DIR is what `python -m colibri pack HF_DIR "
    "--layer all --out PACKED_DIR` writes, and must hold exactly the model's MoE layers.")


def _prompt_ids(text):
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 1,2,3, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids are >= 0, got {text!r}")
    return ids


def _at_least(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def parse_args(argv):
    # Every help text is a whole sentence (tests/test_help.py reads them as printed at 80 columns).
    parser = argparse.ArgumentParser(prog="python -m colibri generate", description=DESCRIPTION, epilog=EPILOG,
                                     add_help=False)
    parser.add_argument("-h", "--help", action="help", help="Show this help and exit.")
    parser.add_argument("--url", metavar="HOST:PORT",
                        help="The expert tier's Triton gRPC endpoint, e.g. 127.0.0.1:8001 (grpc and cudashm).")
    parser.add_argument("--model", required=True, type=pathlib.Path, metavar="HF_DIR",
                        help="The Hugging Face model folder: config.json and safetensors shards (the expert "
                             "weights in them are not read).")
    parser.add_argument("--prompt-ids", required=True, type=_prompt_ids, metavar="1,2,3",
                        help="The prompt, as comma-separated token ids of the model's vocabulary.")
    parser.add_argument("--max-new-tokens", required=True, type=_at_least(1), metavar="N",
                        help="How many tokens to generate (an end-of-sequence token does not stop it).")
    parser.add_argument("--protocol", choices=("grpc", "cudashm", "inprocess"), default="grpc",
                        help="How the MoE blocks reach the expert tier: grpc (--url), cudashm (--url, hidden "
                             "states in CUDA shared memory; --device cuda) or inprocess (--weights, no server) "
                             "(default: %(default)s).")
    parser.add_argument("--weights", type=pathlib.Path, metavar="PACKED_DIR",
                        help="The folder of layer{N}.colibri.safetensors files inprocess computes with.")
    parser.add_argument("--device", default="cpu", metavar="cpu|cuda",
                        help="Where the attention tier runs, and inprocess layers and cudashm regions live "
                             "(cpu, cuda or cuda:N; default: %(default)s).")
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                        help="The attention tier's dtype (default: auto, the one config.json names).")
    parser.add_argument("--triton-model", default="colibri_moe", metavar="NAME",
                        help="The Triton model of the expert tier (default: %(default)s).")
    parser.add_argument("--warmup", type=_at_least(0), default=1, metavar="N",
                        help="Untimed runs of the prompt (2 new tokens each) before the timed one "
                             "(default: %(default)s).")
    parser.add_argument("--json", required=True, type=pathlib.Path, metavar="OUT.json",
                        help="Where to write {\"tokens\": [...], \"ttft_ms\": ..., \"tpot_ms\": ...}.")
    return parser.parse_args(argv)


def _problem(args):
    """What is wrong with the arguments together, in one line, before anything is loaded."""
    if args.protocol in ("grpc", "cudashm") and not args.url:
        return f"--protocol {args.protocol} needs --url HOST:PORT of the expert tier's gRPC endpoint"
    if args.protocol == "inprocess" and args.weights is None:
        return "--protocol inprocess needs --weights PACKED_DIR (pack HF_DIR --layer all --out PACKED_DIR)"
    if args.protocol == "inprocess" and not args.weights.is_dir():
        return f"--weights {args.weights}: not a folder (pack --layer all --out PACKED_DIR writes one)"
    if args.protocol == "cudashm" and not args.device.startswith("cuda"):
        return "--protocol cudashm needs --device cuda: its regions hold the hidden states on the GPU"
    if not args.model.is_dir():
        return f"--model {args.model}: no such folder"
    if not args.json.parent.is_dir():
        return f"--json {args.json}: folder {args.json.parent} does not exist"
    return None


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    problem = _problem(args)
    if problem:
        print(f"colibri generate: {problem}", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401 (only whether they import)
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"colibri generate: needs torch and transformers (pip install 'colibri-moe[attention]'): {exc}",
              file=sys.stderr)
        return 2
    from colibri.attention import AttentionTier, expert_tier
    experts = tier = None
    try:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise ColibriError(f"--device {args.device}: torch sees no CUDA GPU on this host")
        experts = expert_tier(args.protocol, url=args.url, weights=args.weights, device=args.device,
                              model=args.triton_model)
        tier = AttentionTier.from_pretrained(args.model, experts, device=args.device,
                                             dtype=None if args.dtype == "auto" else args.dtype)
        prompt = tier.check_prompt(args.prompt_ids)
        for _ in range(args.warmup):
            tier.generate(prompt, min(2, args.max_new_tokens))
        result = tier.generate(prompt, args.max_new_tokens)
    except ColibriError as exc:
        print(f"colibri generate: {exc}", file=sys.stderr)
        return 1
    finally:
        if tier is not None:
            tier.close()
        elif experts is not None:
            experts.close()
    args.json.write_text(json.dumps({"tokens": result.tokens, "ttft_ms": result.ttft_s * 1e3,
                                     "tpot_ms": result.tpot_s * 1e3}) + "\n")
    print(f"colibri generate: {len(result.tokens)} tokens after {result.prompt_tokens} prompt tokens, TTFT "
          f"{result.ttft_s * 1e3:.2f} ms, TPOT {result.tpot_s * 1e3:.2f} ms ({args.protocol}); wrote {args.json}")
    return 0
