"""What ``neo serve`` does around loading the model: claim the listening socket first, so a port
in use is reported before any weight loads, and print a banner once the server listens."""

import errno
import socket

from neo.bench import device_name
from neo.engine import LLMEngine
from neo.engine.build import host_kernels
from neo.request import KVLocation

GIB = 2**30


class ListenError(ValueError):
    """The server cannot listen on the host and port it was given."""


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (not yet listening; uvicorn listens on it).

    Raises ``ListenError`` naming the host and port when the address is in use, cannot be
    assigned on this machine, or does not resolve.
    """
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise ListenError(f"cannot listen on {host}:{port}: the host does not resolve "
                          f"({error.strerror})") from None
    # The protocol spelled out (IPPROTO_TCP): asyncio sets TCP_NODELAY only on sockets that
    # name it, and without it small responses wait for the client's delayed ACK.
    listener = socket.socket(family, kind, protocol or socket.IPPROTO_TCP)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
    except OSError as error:
        listener.close()
        reason = ("the address is already in use" if error.errno == errno.EADDRINUSE
                  else error.strerror or str(error))
        raise ListenError(f"cannot listen on {host}:{port}: {reason}") from None
    listener.set_inheritable(True)
    return listener


def _pool_text(num_blocks: int, block_size: int, block_bytes: int) -> str:
    return (f"{num_blocks} blocks, {num_blocks * block_size} tokens, "
            f"{num_blocks * block_bytes / GIB:.2f} GiB")


def banner(engine: LLMEngine, served_model_name: str, url: str) -> str:
    """The lines ``neo serve`` prints once it is ready: what runs and where to reach it."""
    config = engine.config
    pools = engine.block_manager.pools
    block_bytes = engine.layout.block_bytes
    kernel = host_kernels(config.cpu_attention_kernel).attention.name
    pipeline = config.host_pipeline if config.policy != "gpu-only" else "none (gpu-only)"
    rows = [
        ("model", f"{config.model} ({str(engine.dtype).removeprefix('torch.')}, context "
                  f"{engine.max_model_len} tokens, on {device_name(engine.device)})"),
        ("served as", served_model_name),
        ("policy", config.policy),
        ("host pipeline", pipeline),
        ("GPU KV pool", _pool_text(pools[KVLocation.GPU].num_blocks, config.block_size,
                                   block_bytes)),
        ("CPU KV pool", _pool_text(pools[KVLocation.HOST].num_blocks, config.block_size,
                                   block_bytes)),
        ("CPU attention", kernel),
        ("listening on", f"{url}/v1 (OpenAI API), {url}/metrics, {url}/health"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(["neo is serving"] + [f"  {name:<{width}}  {value}" for name, value in rows])


def url_of(host: str, port: int) -> str:
    """``http://host:port``; an IPv6 address goes in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
