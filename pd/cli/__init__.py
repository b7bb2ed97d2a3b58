"""``pd``: the command line. ``pd generate`` runs the colocated engine (``pd.cli.generate``);
``pd serve`` the cluster or the colocated engine behind the HTTP server (``pd.cli.serve``);
``pd scale`` and ``pd status`` operate a running server's cluster (``pd.cli.admin``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from pd.cli.flags import AUTOSCALE_PREFIX, add_dataclass_args, dataclass_from_args, groups_of
from pd.cluster.client_config import ClientConfig
from pd.core import envs
from pd.executor.config import EngineConfig
from pd.fleet.autoscaler import AutoscalerConfig
from pd.fleet.config import ClusterConfig
from pd.model.loader import ModelLoadError
from pd.router.policy import CoordinatorConfig
from pd.server.config import ServerConfig
from transfer.state import TransferConfig

logger = logging.getLogger(__name__)

# the transfer deadlines every node uses, and the connections each internal socket takes, as
# --transfer-* flags
TRANSFER_FLAGS = ("handshake_timeout_s", "timeout_s", "connect_timeout_s", "max_conns")
# ``pd serve``'s engine defaults where they differ from ``EngineConfig``'s (those of the library
# and ``pd generate``: fp32 weights, eager steps): on a CPU, int4 weights and compiled decode
# steps for batches of 1, 2 and 4 (docs/bench/history.md, "pd serve's defaults on a CPU")
SERVE_ENGINE_DEFAULTS = {"quantization": "auto", "compile_buckets": "auto"}
# EngineConfig's fields by group; the others are engine flags
ENGINE_GROUPS = {
    "enable_prefix_cache": "cache tiers",
    "host_cache_tokens": "cache tiers",
    "disk_cache_dir": "cache tiers",
    "disk_cache_gb": "cache tiers",
    "disk_cache_min_free_gb": "cache tiers",
    "disk_cache_min_free_percent": "cache tiers",
    "speculative_tokens": "speculation",
    "speculative_max_batch": "speculation",
}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return dataclass_from_args(EngineConfig, args)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """``pd serve``'s ServerConfig; the keys of --api-key-file and PD_API_KEY join the
    --api-key flags, and those of --admin-api-key-file and PD_ADMIN_API_KEY the
    --admin-api-key flags."""
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    kwargs = {k: v for k, v in vars(args).items() if k in names and v is not None}
    tenants = read_key_file(args.api_key_file, "--api-key-file")
    admins = read_key_file(args.admin_api_key_file, "--admin-api-key-file")
    kwargs["api_key"] = (*(args.api_key or ()), *(k for k, _ in tenants), *envs.PD_API_KEY)
    kwargs["admin_api_key"] = (
        *(args.admin_api_key or ()),
        *(k for k, _ in admins),
        *envs.PD_ADMIN_API_KEY,
    )
    kwargs["key_groups"] = tuple((k, g) for k, g in (*tenants, *admins) if g is not None)
    return ServerConfig(**kwargs)


def read_key_file(path: str | None, flag: str) -> tuple[tuple[str, str | None], ...]:
    """The keys in ``path`` (none for None), each with its key group or None: one a line, or
    comma-separated as in PD_API_KEY, then optionally a space and the group of the line's keys
    (``KEY GROUP``); blank lines are skipped. A file that cannot be read or holds no key is an
    error; one that group or others may read is served, with a warning (a mounted Kubernetes
    secret is 0644)."""
    if path is None:
        return ()
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path} is not UTF-8 text") from None
    keys: list[tuple[str, str | None]] = []
    for i, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if len(fields) > 2:
            raise ValueError(
                f"{flag} {path} line {i} has {len(fields)} fields: KEY or KEY GROUP, keys "
                "comma-separated"
            )
        group = fields[1] if len(fields) == 2 else None
        keys += [(k.strip(), group) for k in fields[0].split(",") if k.strip()] if fields else []
    if not keys:
        raise ValueError(f"{flag} {path} holds no key (one a line)")
    if mode & 0o077:
        logger.warning(
            "%s %s may be read by group or others (mode %o): chmod 600 it", flag, path, mode & 0o777
        )
    return tuple(keys)


def cmd_generate(args: argparse.Namespace) -> int:
    from pd.cli.generate import generate

    return generate(args, engine_config(args))


def cmd_serve(args: argparse.Namespace) -> int:
    from pd.cli.serve import serve

    # before the config is read: its warnings (a key file others may read) are logged too
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return serve(args, engine_config(args), server_config(args))


def cmd_scale(args: argparse.Namespace) -> int:
    from pd.cli.admin import scale

    return scale(args)


def cmd_status(args: argparse.Namespace) -> int:
    from pd.cli.admin import status

    return status(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with the colocated engine")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    add_dataclass_args(gen, EngineConfig, group=ENGINE_GROUPS)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_serve_args(srv)
    add_dataclass_args(srv, EngineConfig, group=ENGINE_GROUPS)
    srv.set_defaults(**SERVE_ENGINE_DEFAULTS)
    cluster = "cluster and Ray"
    add_dataclass_args(
        srv, ClientConfig, only=("heartbeat_timeout_s", "token_probe_s"), group=cluster
    )
    add_dataclass_args(srv, TransferConfig, "transfer_", only=TRANSFER_FLAGS, group=cluster)
    _add_security_args(srv)
    add_dataclass_args(srv, AutoscalerConfig, prefix=AUTOSCALE_PREFIX, group="autoscaling")
    srv.set_defaults(func=cmd_serve)

    scale = sub.add_parser("scale", help="resize a running server's prefill and decode pools")
    scale.add_argument("--prefill", type=int, default=None, help="prefill nodes wanted")
    scale.add_argument("--decode", type=int, default=None, help="decode nodes wanted")
    scale.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wait until every pool has its size and no node starts or drains",
    )
    scale.add_argument("--timeout", type=float, default=600.0, help="seconds to wait at most")
    _add_server_args(scale)
    scale.set_defaults(func=cmd_scale)

    status = sub.add_parser("status", help="a running server's nodes and pools")
    status.add_argument("--json", action="store_true", help="print GET /admin/nodes as it is")
    _add_server_args(status)
    status.set_defaults(func=cmd_status)
    return parser


def _add_security_args(parser: argparse.ArgumentParser) -> None:
    """ServerConfig's flags, with the key files beside the key flags."""
    title = "security and limits"
    keys = ("api_key", "admin_api_key")
    add_dataclass_args(parser, ServerConfig, only=keys, group=title)
    group = groups_of(parser)[title]
    for role, env in (("api", "PD_API_KEY"), ("admin-api", "PD_ADMIN_API_KEY")):
        group.add_argument(
            f"--{role}-key-file",
            default=None,
            metavar="PATH",
            help=f"--{role}-key's keys read from a file, one a line (a flag's key shows in "
            f"`ps`; a file's, like {env}'s, does not); a line `KEY GROUP` puts the key in a key "
            "group, whose keys share cached prefixes and a cache share (--cache-share)",
        )
    rest = tuple(
        f.name for f in dataclasses.fields(ServerConfig) if f.name not in (*keys, "key_groups")
    )
    add_dataclass_args(parser, ServerConfig, only=rest, group=title)


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the pd server")
    parser.add_argument(
        "--api-key",
        default=None,
        help="an admin API key, sent as `Authorization: Bearer <key>`; default: the first of "
        "PD_ADMIN_API_KEY, else of PD_API_KEY",
    )


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags, ``ClusterConfig``'s and ``CoordinatorConfig``'s."""
    server = groups_of(parser)["server"]
    server.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    server.add_argument("--port", type=int, default=8000, help="HTTP port")
    server.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send; default: the model dir's name",
    )
    add_dataclass_args(parser, ClusterConfig, group="cluster and Ray")
    parser.set_defaults(num_prefill=None)  # ``pd.cli.serve.prefill_pool_size`` decides
    add_dataclass_args(parser, CoordinatorConfig, group="routing")
    server.add_argument(
        "--colocated",
        action="store_true",
        help="serve one in-process engine (prefill and decode together, no Ray) instead",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ModelLoadError, ConnectionError) as e:
        print(f"pd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C on `pd serve`: it has shut down already
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
