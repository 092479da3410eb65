"""python -m colibri {pack,demo,serve,bench,generate,info,probe,watch,stage}"""
import argparse
import importlib
import pathlib
import sys
import time

from colibri import checkpoint
from colibri._native import ColibriError
from colibri.config import EXPERT_KINDS, ROUTINGS

# The runtime and `demo`/`info`/`probe`/`watch` run on Python 3.8 (the CUDA 11.8 image); these are
# developer tools, written for and tested on 3.10+ only (backend_src/pyproject.toml).
DEVELOPER_COMMANDS = ("pack", "serve", "bench", "generate")


# serve, bench and generate live in modules of their own (with their own options): imported only when asked.
DELEGATED = {"serve": "colibri.serving.launcher", "bench": "colibri.bench", "generate": "colibri.attention.cli"}


def _delegate(command: str, argv) -> int:
    module = DELEGATED[command]
    try:
        target = importlib.import_module(module)
    except ImportError as exc:
        print(f"colibri {command}: {module.replace('.', '/')}.py is not available ({exc})", file=sys.stderr)
        return 2
    return target.main(list(argv)) or 0


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _layer(text: str):
    if text == "all":
        return text
    try:
        return int(text)  # a negative one too: pack refuses it naming the model's range of layers
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer index or 'all', got {text!r}") from None


def _help_option(parser) -> None:
    # argparse's own "-h" help is not a sentence; every help paragraph here is one (tests/test_help.py).
    parser.add_argument("-h", "--help", action="help", help="Show this help and exit.")


def _subparser(sub, name, **kwargs) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, add_help=False, **kwargs)
    _help_option(parser)
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m colibri", add_help=False,
                                     description="Colibri, a Mixture-of-Experts layer engine served by Triton.")
    _help_option(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="One of the commands below; `python -m colibri COMMAND --help` gives its options.")
    sub.add_parser("serve", help="Serve the model with tritonserver on this host.")
    sub.add_parser("bench", help="Run the benchmarks.")
    sub.add_parser("generate", help="Generate from a Hugging Face MoE model whose MoE blocks run on the expert tier.")
    sub.add_parser("probe", help="Check liveness with one real one-token request.")
    sub.add_parser("watch", help="Run a server command and restart it when it dies or stops answering.")

    pack = _subparser(sub, "pack", help="Convert MoE layers of a Hugging Face safetensors checkpoint.",
                      description="Packs MoE layers of a Hugging Face model whose config.json names a family "
                                  "pack knows: mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3, "
                                  "glm4_moe, gpt_oss (its MXFP4 experts are dequantised to bf16, exactly). "
                                  "fp8 e4m3 checkpoints (quantization_config quant_method fp8, fbgemm_fp8 or "
                                  "compressed-tensors: block, per-channel or per-tensor scales) are packed as "
                                  "stored. A dense model (no MoE layer) is refused at once; another model_type or "
                                  "a folder without config.json only with --unverified-routing.")
    pack.add_argument("src", help="A .safetensors file, a folder of shards, or a model.safetensors.index.json.")
    pack.add_argument("--out", required=True, metavar="FILE",
                      help="The *.colibri.safetensors file to write (with --layer all: a folder, written with "
                           "layer{N}.colibri.safetensors files).")
    pack.add_argument("--layer", type=_layer, metavar="N",
                      help="The decoder layer to pack, from 0, or 'all' for every MoE layer (default: the first "
                           "MoE layer).")
    pack.add_argument("--dtype", default="keep", choices=("keep", "bf16", "fp16", "fp32", "fp8"),
                      help="The packed experts' dtype (default: keep, the source's). fp8: e4m3, an fp8 source as "
                           "stored, any other quantised in 128x128 blocks (scale = amax / 448); bf16, fp16, fp32 "
                           "from an fp8 source: dequantised.")
    pack.add_argument("--verify", action="store_true",
                      help="Compare each packed layer with transformers' own MoE block (needs torch and "
                           "transformers; loaded with the weights the packed layer holds, fp8 ones dequantised); "
                           "a layer off by more than 1e-5 is deleted and pack fails.")
    pack.add_argument("--unverified-routing", action="store_true",
                      help="Accept an unknown model_type or no config.json, and the overrides below: the layer "
                           "may then compute something other than the model.")
    pack.add_argument("--top-k", type=int, metavar="K",
                      help="Override config.json num_experts_per_tok (with --unverified-routing).")
    pack.add_argument("--routing", choices=ROUTINGS,
                      help="Override the family's routing (with --unverified-routing).")
    pack.add_argument("--renormalize", type=_bool, metavar="true|false",
                      help="Override norm_topk_prob (with --unverified-routing).")
    pack.add_argument("--routed-scaling-factor", type=float, metavar="X",
                      help="Override config.json routed_scaling_factor (with --unverified-routing).")
    pack.add_argument("--quiet", action="store_true", help="Print no progress bar.")

    demo = _subparser(sub, "demo", help="Write a synthetic demo checkpoint.",
                      description="Writes a packed checkpoint of random weights (normal, of variance 1/fan_in) "
                                  "with a router, to serve or benchmark without a real model.")
    d = checkpoint.DEMO_DEFAULTS
    demo.add_argument("--out", required=True, metavar="FILE", help="The *.colibri.safetensors file to write.")
    demo.add_argument("--experts", type=int, default=d["experts"], metavar="E",
                      help="Number of experts (default: %(default)s).")
    demo.add_argument("--top-k", type=int, default=d["top_k"], metavar="K",
                      help="Experts per token (default: %(default)s).")
    demo.add_argument("--hidden", type=int, default=d["hidden"], metavar="H",
                      help="Hidden size, the width of a request's tokens (default: %(default)s).")
    demo.add_argument("--intermediate", type=int, default=d["intermediate"], metavar="F",
                      help="Each expert's intermediate size (default: %(default)s).")
    demo.add_argument("--dtype", default=d["dtype"], choices=("bf16", "fp16", "fp32", "fp8"),
                      help="The experts' dtype; fp8: e4m3 with 128x128 scale blocks (default: %(default)s).")
    demo.add_argument("--seed", type=int, default=d["seed"], help="Random seed (default: %(default)s).")
    demo.add_argument("--routing", default=d["routing"], choices=ROUTINGS,
                      help="The built-in routing (default: %(default)s).")
    demo.add_argument("--kind", default=d["kind"], choices=EXPERT_KINDS,
                      help="The experts' kind (default: %(default)s).")
    demo.add_argument("--renormalize", type=_bool, default=None, metavar="true|false",
                      help="Whether the top-k weights are renormalised (default: true).")
    demo.add_argument("--routed-scaling-factor", type=float, default=1.0, metavar="X",
                      help="Factor on the routing weights (default: %(default)s).")

    info = _subparser(sub, "info", help="Check a packed checkpoint and print its configuration.",
                      description="Checks a packed checkpoint as loading it does (its header, shapes, metadata and "
                                  "that every weight is finite: one pass over the file), then prints its "
                                  "configuration, tensors and metadata.")
    info.add_argument("file", help="A *.colibri.safetensors file.")
    stage = _subparser(sub, "stage", help="Copy a model repository whose colibri_moe config names the checkpoint.",
                       description="Copies a model repository (as links) whose colibri_moe config names the "
                                   "checkpoint served: its path, size, time, sha256 and whether it is a demo. The "
                                   "image's entrypoint runs it; `serve` does the same.")
    stage.add_argument("repository", help="The model repository, e.g. /models.")
    stage.add_argument("--weights", required=True, metavar="FILE|DIR",
                       help="The checkpoint the server will load (a file, or a folder of layer files).")
    stage.add_argument("--out", required=True, metavar="DIR", help="The copy's folder, which must not exist yet.")
    stage.add_argument("--model", default="colibri_moe", help="The model to name it in (default: %(default)s).")
    return parser


def out_problem(out):
    """Why `out` cannot be written as a new file, in one line, or None. Checked before the work, so a
    pack of a large model does not read it all to fail at the end."""
    out = pathlib.Path(out)
    if out.is_dir():
        return f"--out {out}: is a folder; give the file to write, e.g. {out / 'layer.colibri.safetensors'}"
    if not out.parent.exists():
        return f"--out {out}: folder {out.parent} does not exist (create it first: mkdir -p {out.parent})"
    if not out.parent.is_dir():
        return f"--out {out}: {out.parent} is not a folder"
    return None


def _printable(value) -> str:
    """Text from a file, safe to print: control characters escaped (no terminal escapes, one line per
    field), and what this terminal's encoding cannot show as backslash escapes."""
    text = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in str(value))
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    return text.encode(encoding, "backslashreplace").decode(encoding)


def _info(path) -> None:
    """Checks what loading the layer checks, all of it (the weights' finiteness included, in one pass of
    the library over the file), then prints the layer."""
    from colibri.layer import MoELayer
    ckpt = checkpoint.load(path)
    started = time.perf_counter()
    MoELayer.from_checkpoint(ckpt, path, device="cpu", workspace_tokens=1)
    seconds = time.perf_counter() - started
    for field, value in vars(ckpt.config).items():
        print(f"{field:22} {value}")
    for name, tensor in ckpt.file.tensors.items():
        print(f"tensor {_printable(name):15} {tensor.dtype:5} {list(tensor.shape)}")
    for key, value in sorted(ckpt.metadata.items()):
        if key not in checkpoint.config_metadata(ckpt.config):
            print(f"metadata {_printable(key):20} {_printable(value)}")
    print(f"checked: the layer loads and every weight is finite ({ckpt.file.path.stat().st_size} bytes in "
          f"{seconds:.2f} s)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DEVELOPER_COMMANDS and sys.version_info < (3, 10):
        print(f"colibri {argv[0]}: needs Python 3.10 or newer, this is {sys.version.split()[0]} "
              "(before 3.10: demo, info, probe and watch)", file=sys.stderr)
        return 2
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    if argv and argv[0] in ("probe", "watch"):
        from colibri.serving import watchdog
        return (watchdog.main_probe if argv[0] == "probe" else watchdog.main_watch)(argv[1:])
    args = _parser().parse_args(argv)
    all_layers = args.command == "pack" and args.layer == "all"
    problem = out_problem(args.out) if args.command in ("pack", "demo") and not all_layers else None
    if problem:
        print(f"colibri {args.command}: {problem}", file=sys.stderr)
        return 1
    try:
        if args.command == "pack":
            from colibri import pack
            configs = pack.pack(args.src, args.out, layer=args.layer, dtype=args.dtype, top_k=args.top_k,
                                routing=args.routing, renormalize=args.renormalize,
                                routed_scaling_factor=args.routed_scaling_factor, progress=not args.quiet,
                                unverified_routing=args.unverified_routing, verify=args.verify)
            checked = " (verified against transformers)" if args.verify else ""
            if all_layers:
                print(f"colibri pack: wrote {len(configs)} layers into {args.out}{checked}")
            else:
                print(f"colibri pack: wrote {args.out}{checked}")
        elif args.command == "demo":
            config = checkpoint.write_demo(args.out, experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                                           intermediate=args.intermediate,
                                           dtype="fp8_e4m3" if args.dtype == "fp8" else args.dtype, seed=args.seed,
                                           routing=args.routing, kind=args.kind, renormalize=args.renormalize,
                                           routed_scaling_factor=args.routed_scaling_factor)
            print(f"colibri demo: wrote {args.out} ({config})")
        elif args.command == "info":
            _info(args.file)
        elif args.command == "stage":
            from colibri.serving import triton_config
            checkpoint_id = triton_config.stage_repository(args.repository, args.out, args.model, args.weights)
            if checkpoint_id.note:  # hashed now: what it cost, and whether the next start pays it again
                print(f"colibri stage: {checkpoint_id.note}", file=sys.stderr)
    except ColibriError as exc:
        print(f"colibri {args.command}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. a folder without write permission: one line, not a traceback
        print(f"colibri {args.command}: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
