"""`mars serve`: the OpenAI-compatible server (parse the flags, load, serve)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer
from typer import echo

from . import flags as opt
from .typed import warn
from ..core.defaults import DEFAULTS
from ..core.errors import MarsError

PARALLEL = typer.Option(
    DEFAULTS.parallel_serve, "--parallel", "-np", metavar="N",
    help="Requests decoded together in one batch per round (continuous batching; each sequence holds up "
         "to -c tokens, so the KV cache is N times a lone one). 0 = auto: 8, fewer where their KV caches "
         "would take over half the free memory (the GPUs' with -ngl). 1 = one at a time, reusing any "
         "cached prefix of the next prompt (a chat's conversation).",
)
QUEUE = typer.Option(
    DEFAULTS.queue_size, "--queue", help="Requests that may wait for the engine; more get 503."
)


@opt.generation_options
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8080, "--port", help="Port (0: a free one, printed at start)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="MARS_API_KEY", help="Require 'Authorization: Bearer KEY' (env MARS_API_KEY)."
    ),
    queue: int = QUEUE,
    parallel: int = PARALLEL,
    n_predict: int = typer.Option(
        DEFAULTS.max_tokens_serve, "-n", "--n-predict", "--predict",
        help="Default max tokens of a request without max_tokens (-1: until the end or a full context).",
    ),
    alias: Optional[str] = typer.Option(None, "--alias", help="The model id clients see (default: the model's name)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No line per request on stderr."),
    cors: Optional[List[str]] = typer.Option(
        None, "--cors", metavar="ORIGIN", help="Let web pages from this origin call the API from a browser (repeatable; '*' = any)."
    ),
    allowed_host: Optional[List[str]] = typer.Option(
        None, "--allowed-host", metavar="NAME",
        help="Accept requests whose Host is NAME (repeatable; on loopback only loopback names and --host are "
             "accepted by default, elsewhere any unless this is given).",
    ),
    gen: opt.GenOptions = None,
) -> None:
    """Serve the models over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...)."""
    from ..server import bind, check_allowed_host, check_installed, check_origin

    check_installed()
    opt.check_flag("max_tokens", n_predict)
    opt.check_flag("queue_size", queue, queue_size=QUEUE)
    opt.check_flag("parallel", parallel, parallel=PARALLEL)
    if api_key is not None and not api_key.strip():
        raise MarsError("--api-key is empty")
    if alias is not None and not alias.strip():
        raise MarsError("--alias is empty")
    origins = tuple(dict.fromkeys(check_origin(o) for o in cors or ()))
    hosts = tuple(dict.fromkeys(check_allowed_host(h) for h in allowed_host or ()))
    choice = gen.choice()
    cfg = gen.config(choice, n_predict)
    sock = bind(host, port)  # a busy port fails before the models load
    try:
        eng = gen.engine(choice)
    except BaseException:
        sock.close()
        raise
    try:
        from ..speculate.batch_cost import resolve_parallel

        _serve(eng, sock, choice, cfg, host=host, alias=alias, api_key=api_key, queue=queue, quiet=quiet,
               origins=origins, hosts=hosts, parallel=resolve_parallel(eng, parallel))
    finally:
        sock.close()
        eng.close()


def _serve(eng, sock, choice, cfg, *, host: str, alias: Optional[str], api_key: Optional[str], queue: int,
           quiet: bool, origins: tuple, hosts: tuple, parallel: int = 1) -> None:
    """Serve on the bound ``sock`` until stopped (Ctrl-C)."""
    from ..server import is_loopback, run_server
    from ..server.app import ServerSettings, create_app

    target = Path(choice.target)
    model_id = alias or (choice.label if choice.pair is not None else target.stem)
    aliases = tuple({choice.label, target.name, target.stem, str(choice.target)} - {model_id})
    info = {"drafter": choice.drafter, "verify": cfg.verify, "n_ctx": eng.n_ctx}
    settings = ServerSettings(cfg, model_id, aliases, api_key, queue, log=not quiet, info=info,
                              cors=origins, host=host, allowed_hosts=hosts, parallel=parallel)
    app = create_app(eng, settings)
    worker = app.state.server.worker
    try:  # the generation thread times the target (once per machine) before the server listens
        spent = worker.warm_up()
    except KeyboardInterrupt:
        _stop_worker(worker, sock)
        raise
    if spent:
        echo(f"mars serve: timed the target's batched forwards once on this machine ({spent:.1f} s; "
             "later starts reuse them)", err=True)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host

    def ready() -> None:
        echo(f"mars serve: {model_id} (drafter: {choice.drafter}, verify: {cfg.verify}"
             + (f", {parallel} requests at once" if parallel > 1 else "") + ") on "
             f"http://{shown}:{bound_port}/v1", err=True)
        if not is_loopback(host) and api_key is None:
            warn(f"listening on {host} without --api-key: anyone who can reach this port can use the model")

    try:
        run_server(app, sock, ready, on_shutdown=worker.cancel_all)  # requests in flight end with a 503 at once
    finally:
        # uvicorn skips the app's shutdown when forced (a second Ctrl-C), and re-raises the Ctrl-C
        # it caught once it returns: the worker is stopped here too, before the models are freed
        # (a forward still running, a long prompt's prefill, would crash on freed weights)
        _stop_worker(worker, sock)


def _stop_worker(worker, sock) -> None:
    """End the generation thread; never free the models under a forward still running."""
    if not worker.stop(timeout=30.0):
        echo("mars serve: a generation did not stop in time; exiting without freeing the models", err=True)
        sock.close()
        os._exit(130)
