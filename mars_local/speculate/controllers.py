"""The adaptive draft-length controllers of one Engine, and what they learn between runs.

Acceptance depends on the verification regime (rule, θ, greedy or sampled),
so each regime has its own :class:`~mars_local.speculate.adaptive.AdaptiveK`; window and
draft costs depend only on the models and the machine, so the controllers of
one Engine share them.  What they learn is kept in a
:class:`~mars_local.speculate.learned.LearnedStore` under keys naming what it depends on.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator
from os import PathLike

from .adaptive import AdaptiveK
from .learned import LearnedStore, file_fingerprint

__all__ = ["Controllers", "learned_keys", "calibrate"]

CALIBRATION_WINDOWS = (1, 2, 3, 5, 9, 17)  # verify-window sizes timed once (plus k_max + 1)


def learned_keys(
    target: str | PathLike, draft: str | PathLike | None, drafter: str, ngram: tuple[int, int], *,
    build: str, device: str, n_gpu_layers: int | None, n_gpu_layers_draft: int | None,
) -> dict[str, str | None]:
    """The store keys of what the controllers learn: window costs (target, build,
    device), draft costs (both models: they share memory bandwidth) and the
    fingerprints acceptance is keyed by (target, drafter), and what batched rounds
    learned (batched forward costs, drafting's and plain rounds' rates: both models,
    the drafter, the build and the device).  (Draft costs are keyed
    "draft|v2|...": those learned before a drafter's catch-up on plainly decoded
    tokens was kept out of them were many times too high, and are not read.)"""
    drafter_id = file_fingerprint(draft) if draft else f"{drafter}{ngram[0]}-{ngram[1]}"
    return {
        "batch": f"batch|v1|{drafter_id}|{file_fingerprint(target)}|{build}|{device}"
                 f"|ngl{n_gpu_layers}|ngld{n_gpu_layers_draft}",
        "costs": f"costs|{file_fingerprint(target)}|{build}|{device}|ngl{n_gpu_layers}",
        "draft": f"draft|v2|{file_fingerprint(draft)}|{file_fingerprint(target)}|{build}|{device}"
                 f"|ngl{n_gpu_layers_draft}" if draft else None,
        "drafter": drafter_id,
        "target": file_fingerprint(target),
    }


class Controllers:
    """One controller per acceptance regime, sharing one cost model; loaded from
    and saved to ``store`` (None: nothing is kept between Engines)."""

    def __init__(self, store: LearnedStore | None, keys: dict[str, str | None], gpu: bool):
        self._store, self._keys, self._gpu = store, keys, gpu
        self._by_regime: dict[tuple, AdaptiveK] = {}
        self._batch: dict | None = None  # batched rounds' state to save (keep_batch_state)

    def batch_state(self) -> dict | None:
        """What a :class:`~mars_local.speculate.batched.Scheduler` of these models kept (None: nothing)."""
        if self._store is None or not self._keys.get("batch"):
            return None
        state = self._store.get(self._keys["batch"])
        return state if isinstance(state, dict) else None

    def keep_batch_state(self, state: dict) -> None:
        """Save ``state`` (a Scheduler's) with the controllers, at the next :meth:`save`."""
        self._batch = state

    def __iter__(self) -> Iterator[AdaptiveK]:
        return iter(self._by_regime.values())

    def __len__(self) -> int:
        return len(self._by_regime)

    def get(self, regime: tuple[Hashable, ...], k_max: int) -> AdaptiveK:
        """The regime's controller (made on first use: costs shared with the
        others, or loaded from the store; acceptance loaded from the store)."""
        ctrl = self._by_regime.get(regime)
        if ctrl is None:
            first = next(iter(self._by_regime.values()), None)
            ctrl = AdaptiveK(k_max=k_max, gpu=self._gpu)
            if first is not None:
                ctrl.share_costs(first)
            elif self._store is not None:
                for part in ("costs", "draft"):
                    key = self._keys[part]
                    if key and (state := self._store.get(key)):
                        ctrl.import_state(state)
            if self._store is not None:
                ctrl.import_state(self._store.get(self._accept_key(regime)) or self._strict_prior(regime) or {})
            self._by_regime[regime] = ctrl
        ctrl.k_max = k_max
        return ctrl

    def for_config(self, cfg, k_max: int) -> AdaptiveK | None:
        """The controller of ``cfg``'s regime (a :class:`~mars_local.core.config.GenerateConfig`
        with a drafter), or None where k must stay at draft_max.

        Draft lengths follow measured timings, so they differ from run to run.
        Strict output never depends on them (greedy is exact, sampling is
        sample-and-compare on position-keyed draws), but MARS output and
        sampled drafts do: a run with an explicit seed asks to be reproducible,
        so there k stays fixed at draft_max.
        """
        if not cfg.adaptive or k_max == 0:
            return None
        depends_on_k = cfg.verify == "mars" or (cfg.draft_sampling == "sample" and not cfg.sampling.greedy)
        if cfg.sampling.seeded and depends_on_k:
            return None
        # Acceptance depends on the rule (and θ, and sampling); window costs
        # only on the target, so controllers of different rules share them.
        return self.get((cfg.verify, cfg.theta if cfg.verify == "mars" else None, cfg.sampling.greedy), k_max)

    def _strict_prior(self, regime: tuple) -> dict | None:
        """A MARS regime never learned yet starts from strict verification's acceptance of the
        same pair (MARS accepts every draft strict does, and more): a prior its own rounds soon
        outweigh (import_state caps it), rather than the blind prior that makes a batch's plan
        try drafting just to learn what the pair's strict runs already know."""
        if not regime or regime[0] != "mars":
            return None
        return self._store.get(self._accept_key(("strict", None, *regime[2:])))

    def _accept_key(self, regime: tuple) -> str:
        k = self._keys
        return f"accept|{k['target']}|{k['drafter']}|{'/'.join(str(x) for x in regime)}"

    def save(self) -> None:
        if self._store is None or (not self._by_regime and self._batch is None):
            return  # (nothing learned: the file is not written)
        if self._batch is not None and self._keys.get("batch"):
            self._store.put(self._keys["batch"], self._batch)
        for regime, ctrl in self._by_regime.items():
            st = ctrl.export_state()
            self._store.put(self._accept_key(regime), {"counts": st["counts"]})
        if self._by_regime:  # window and draft timings are shared by every regime's controller (share_costs)
            self._store.put(self._keys["costs"], {"time": st["time"]})
            if self._keys["draft"]:
                self._store.put(self._keys["draft"], {"draft": st["draft"]})
        self._store.save()


def calibrate(ctrl: AdaptiveK, ctx, last: int) -> float:
    """Time verify windows of a few sizes once, on top of what ``ctx`` (the
    target's context) holds, rolled back after each, when the controller has no
    measured window costs: a controller that starts from priors spends a short
    answer finding them.  Returns the seconds spent; the cache is unchanged."""
    if not ctrl.needs_calibration():
        return 0.0
    clock = time.perf_counter
    t_start = clock()
    base, held = ctx.n_past, list(ctx.tokens)
    sizes = [w for w in CALIBRATION_WINDOWS if w <= ctrl.k_max + 1] + [ctrl.k_max + 1]
    for w in sorted(set(sizes)):
        if base + w >= ctx.n_ctx:
            break
        for _ in range(2):  # the first forward of a new size builds its graph and is not timed
            t0 = clock()
            ctx.eval([last] * w, n_out=w)
            ctrl.observe_forward(w, clock() - t0)
            ctx.truncate(base)
    # a recurrent target's state cannot go back over a whole window (llama/recurrent.py): it was
    # dropped, and is evaluated again (once per model and machine, as the calibration itself)
    ctx.sync(held)
    return clock() - t_start
