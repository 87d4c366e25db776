"""Starting a server: load the checkpoint (default: the embedded demo pair), open its offload
engine when its experts are offloaded (`moespec.session.OffloadSettings`, as `generate` takes
them), build the engine and the app, and run uvicorn on a socket bound here (so port 0 picks
a free port)."""

import socket
from collections.abc import Callable
from pathlib import Path

from moespec.errors import SettingError
from moespec.serve.engine import MAX_REQUEST_BYTES, Engine, offload_alone
from moespec.session import OffloadedExperts, OffloadSettings, planned_draft_length


def load_engine(
    model: str | None = None,
    *,
    draft: str | None = None,
    draft_length: int | str = "auto",
    max_draft_length: int = 8,
    kernel: str = "auto",
    crossover: int | None = None,
    plan: str | None = None,
    dtype: str = "bf16",
    max_queue: int = 16,
    max_tokens_limit: int = 1024,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    max_prompt_tokens: int | None = None,
    max_batch: int = 1,
    remember: bool = False,
    offload_settings: OffloadSettings | None = None,
    on_note: Callable[[str], None] | None = None,
) -> Engine:
    """An engine as `moespec generate` would decode: the demo target drafted by the demo draft
    when no model is given; draft "none" (or no draft with another model) decodes plainly.
    offload_settings: the target's experts offloaded as `moespec generate` offloads them, by
    one offload engine for the server's life (at max_batch 1); on_note: a line about how it
    runs (the budget chosen, or one that holds every expert)."""
    from moespec.decoding import KernelPolicy
    from moespec.demo import describe
    from moespec.models import load_model
    from moespec.serve.speculation import build_speculation
    from moespec.serve.text import ChatTemplate, read_chat_template

    check_settings(
        draft=draft,
        kernel=kernel,
        crossover=crossover,
        max_queue=max_queue,
        max_tokens_limit=max_tokens_limit,
        max_request_bytes=max_request_bytes,
        max_prompt_tokens=max_prompt_tokens,
        max_batch=max_batch,
        offload_settings=offload_settings,
    )
    offload_settings = offload_settings or OffloadSettings()
    if model is None:
        from moespec.demo import demo_paths

        model, demo_draft = map(str, demo_paths())
        draft = f"auto:{demo_draft}" if draft is None else draft
    draft = None if draft == "none" else draft
    target, tokenizer = load_model(
        model, dtype=dtype, pack_experts=offload_settings.packs_experts(dtype)
    )
    target.batch_invariant = True  # as `moespec generate` decodes by default
    loaded_plan = None
    if plan is not None:
        from moespec.plan import load_plan

        loaded_plan = load_plan(plan, model=target)
        if crossover is None:
            crossover = loaded_plan.kernel.crossover
    speculation = build_speculation(
        draft,
        target=target,
        tokenizer=tokenizer,
        dtype=dtype,
        draft_length=draft_length,
        max_draft_length=max_draft_length,
        plan=loaded_plan,
    )
    # offloaded, a pass's time is not the model's in memory: not remembered (as in generate)
    if remember and draft is not None and offload_settings.offload is None:
        import torch

        from moespec.decoding.remembered import Remembered

        speculation.remember(
            Remembered.open(model, weights=None, dtype=dtype, threads=torch.get_num_threads())
        )
    special = {"eos_token": tokenizer.decode(list(target.config.eos_token_ids[:1]))}
    chat_template = ChatTemplate(read_chat_template(Path(model)), special)
    offloaded = OffloadedExperts.of(offload_settings, target, draft is not None, on_note)
    k = planned_draft_length(draft_length, max_draft_length) if draft is not None else 0
    offload = offloaded.open(k) if offloaded is not None else None
    try:
        return Engine(
            target,
            tokenizer,
            speculation,
            model_name=describe(model),
            kernels=KernelPolicy(kernel, crossover),
            chat_template=chat_template,
            max_queue=max_queue,
            max_tokens_limit=max_tokens_limit,
            max_request_bytes=max_request_bytes,
            max_prompt_tokens=max_prompt_tokens,
            max_batch=max_batch,
            offload=offload,
        )
    except BaseException:
        if offload is not None:
            offload.close()
        raise


def check_settings(
    *,
    draft=None,
    kernel="auto",
    crossover=None,
    max_queue=16,
    max_tokens_limit=1024,
    max_request_bytes=MAX_REQUEST_BYTES,
    max_prompt_tokens=None,
    max_batch=1,
    offload_settings=None,
    **_,
) -> None:
    """Settings that are wrong whatever the model: fail before it loads (or a port is bound).
    The offload settings are checked (and their defaults filled in) as `generate` checks them."""
    from moespec.decoding import KernelPolicy
    from moespec.decoding.setup import parse_oracle

    KernelPolicy(kernel, crossover)
    Engine.check_limits(
        max_queue, max_tokens_limit, max_request_bytes, max_prompt_tokens, max_batch
    )
    if offload_settings is not None:
        offload_settings.check_offload()
        if offload_settings.offload is not None and max_batch > 1:
            raise SettingError(offload_alone(max_batch))
    if draft is not None and draft.startswith("oracle"):
        parse_oracle(draft)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 takes a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose protocol says TCP, and
    # without it Nagle's algorithm held a response's body ~40 ms behind its headers
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(host: str, port: int, on_listening: Callable[[str, Engine], None], **settings) -> None:
    """Bind (host, port) first (a port in use fails before the model loads), load the engine
    with `settings` (those of load_engine), then serve until Ctrl-C (SIGINT) and return
    after a graceful shutdown; `on_listening(url, engine)` once the socket accepts."""
    import uvicorn

    from moespec.serve.app import create_app

    check_settings(**settings)
    sock = bind(host, port)
    engine = None
    try:
        engine = load_engine(**settings)
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        config = uvicorn.Config(
            create_app(engine), log_level="warning", timeout_graceful_shutdown=5
        )
        on_listening(f"http://{shown}:{bound_port}", engine)
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on: a normal end
        pass
    finally:
        if engine is not None:
            engine.close()
        sock.close()
