"""EngineHost: the engine's life inside the server, from loading to drained.

The engine runs in a task of a nursery the app's lifespan owns (not ``app.nursery``, which
quart-trio cancels before ``after_serving`` runs). States: loading -> ready -> draining ->
closed, or dead when the engine failed. It keeps lifecycle state only: the open requests are
the engine's (``AsyncLLM``: the drain waits for it to be idle and aborts what is left there),
and the metrics observe them through it."""

from __future__ import annotations

import logging

import attrs
import trio

from triode.engine.async_llm import AsyncLLM
from triode.engine.config import EngineArgs
from triode.engine.engine_stats import EngineStatistics
from triode.engine.errors import EngineDeadError
from triode.engine.model.generation_config import GenerationDefaults
from triode.frontend.openai.errors import APIError, shutting_down
from triode.frontend.openai.logprobs import TokenText
from triode.frontend.server.adapters import ServedAdapters
from triode.frontend.server.engine_metrics import CacheConfig
from triode.frontend.server.metrics import ServerMetrics
from triode.frontend.server.settings import LoRAModule, served_model_name

log = logging.getLogger("triode.frontend")

# After the drain window, aborted requests get this long to send their last chunk.
ABORT_GRACE_SECONDS = 5.0


class EngineHost:
    def __init__(self, args: EngineArgs | None = None, lora_modules: tuple[LoRAModule, ...] = ()) -> None:
        self._args = args
        self._lora_modules = lora_modules
        self.adapters: ServedAdapters | None = None  # once ready
        self.llm: AsyncLLM | None = None
        self.nursery: trio.Nursery | None = None  # set by the lifespan
        self.state = "stopped"
        self.error: BaseException | None = None
        self._stop = trio.Event()
        self._done = trio.Event()
        self._metrics: ServerMetrics | None = None
        self._final_statistics: EngineStatistics | None = None
        self.token_text: TokenText | None = None
        self.generation: GenerationDefaults | None = None  # the loaded model's, once ready

    @property
    def args(self) -> EngineArgs:
        """Given to the factory, or read from TRIODE_* variables on first use."""
        if self._args is None:
            self._args = EngineArgs.from_env()
        return self._args

    @property
    def model_name(self) -> str:
        return served_model_name(self.args)

    @property
    def metrics(self) -> ServerMetrics | None:
        """The server's metrics, from the first time the engine was ready (their token
        histograms' buckets follow the model's maximum length); None before."""
        return self._metrics

    def statistics(self) -> EngineStatistics | None:
        """The running engine's statistics; once it has died or stopped, its last ones with
        nothing running, waiting or holding KV blocks (it failed every open request), so that
        /metrics keeps its series and counters (a dashboard's rates, a router's gauges) rather
        than dropping them or showing the requests it held when it died."""
        if self.llm is None:
            return self._final_statistics
        statistics = self.llm.statistics()
        return _at_rest(statistics) if self.health == "dead" else statistics

    @property
    def health(self) -> str:
        if self.state == "ready" and self.llm is not None:
            try:
                self.llm.check_health()
            except EngineDeadError as e:
                self.state, self.error = "dead", e
        return self.state

    def require_ready(self) -> AsyncLLM:
        state = self.health
        if state == "ready" and self.llm is not None:
            return self.llm
        if state == "draining" or state == "closed":
            raise shutting_down()
        if state == "dead":
            reason = str(self.error)  # an EngineDeadError already says the engine failed
            message = reason if isinstance(self.error, EngineDeadError) else f"the engine failed: {reason}"
            raise APIError(503, message, code="engine_dead")
        raise APIError(503, "the model is still loading", code="loading", headers={"Retry-After": "1"})

    async def start(self) -> None:
        """Loads the model and starts the engine; returns once it is ready (raises if not)."""
        assert self.nursery is not None, "the lifespan sets the nursery before start-up"
        await self.nursery.start(self._run)

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.state = "loading"
        started = False
        try:
            async with AsyncLLM.open(self.args) as llm:
                if self._metrics is None:
                    args = self.args
                    cache = CacheConfig(block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
                                        kv_cache_memory_bytes=llm.kv_cache_memory)
                    self._metrics = ServerMetrics(self.model_name, self.statistics, cache=cache,
                                                  max_model_len=llm.max_model_len,
                                                  max_loras=args.max_loras if args.enable_lora else None)
                llm.add_observer(self._metrics)
                self.generation = llm.generation
                adapters = ServedAdapters(self.model_name, self._lora_modules)
                await adapters.start(llm)
                self.adapters = adapters
                # Reads the whole vocabulary once (megabytes for a real tokenizer): off the loop.
                self.token_text = await trio.to_thread.run_sync(TokenText, llm.tokenizer)
                self.llm, self.state = llm, "ready"
                started = True
                task_status.started()
                await self._stop.wait()
        except Exception as e:
            if not started:
                self.state = "closed"
                leaf = _sole_leaf(e)
                if leaf is e:
                    raise
                raise leaf from None  # its message names the problem; a group's does not
            log.exception("the engine failed")
            self.state, self.error = "dead", _sole_leaf(e)
        else:
            self.state = "closed"
        finally:
            if self.llm is not None:
                try:
                    self._final_statistics = _at_rest(self.llm.statistics())
                except Exception:  # a fault of its own must not hide why the engine ended
                    log.exception("the engine's last statistics could not be read")
            self.llm = None
            self._done.set()

    async def drain(self, window: float | None = None) -> None:
        """Stops accepting, waits up to ``window`` seconds (default --shutdown-timeout) for in-flight
        requests, then aborts the rest (they finish with finish_reason "abort")."""
        if self.state not in ("ready", "dead"):
            return
        llm = self.llm
        if self.state == "ready":
            self.state = "draining"
        if llm is None:
            return
        llm.stop_accepting()
        window = self.args.shutdown_timeout if window is None else window
        with trio.move_on_after(window):
            await llm.wait_idle()
        if llm.num_open_requests:
            log.warning("shutdown: aborting %d request(s) still running after %.1f s",
                        llm.num_open_requests, window)
            await self.abort_all()

    async def abort_all(self) -> None:
        """Aborts every in-flight request and gives them a moment to send their last chunk."""
        llm = self.llm
        if llm is None or not llm.num_open_requests:
            return
        for request_id in llm.open_request_ids():
            await llm.abort(request_id)
        with trio.move_on_after(ABORT_GRACE_SECONDS):
            await llm.wait_idle()

    async def close(self) -> None:
        """Drains (if not yet drained) and stops the engine and its workers."""
        if self.state in ("ready", "draining", "dead"):
            await self.drain()
        self._stop.set()
        if self.nursery is not None and self.state != "stopped":
            await self._done.wait()


def _sole_leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _at_rest(statistics: EngineStatistics) -> EngineStatistics:
    """An ended engine's statistics: its counters, and no request, KV block or worker."""
    return attrs.evolve(statistics, num_running=0, num_waiting=0, kv_blocks_free=statistics.kv_blocks_total,
                        worker_pids=(), running_lora_adapters=(), waiting_lora_adapters=())
