"""The judges of one render service: each check by name, run over a batch right after its decode.

A door asks with a `JudgeCall` (judges/call.py: the `JudgeSpec`, plus what only the caller knows: the reference's kept
pHashes, a contrast reference for the identity gap) and gets one `Judgement` per image. The checks
that need no weights (sanity, pHash) run on the host; the identity gap and the embedding hold the
device, like a render. An embedding model is loaded once per service and a reference's embedding
computed once per reference (a small LRU), so a reference's many renders pay for it once.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
from PIL import Image

from snapref_ray.render_service.judges.call import JudgeCall, check_call
from snapref_ray.render_service.judges.embedding import (
    Embedder,
    embedding_passes,
    load_embedder,
    reference_images,
    score_embedding,
)
from snapref_ray.render_service.judges.identity_gap import identity_gap, identity_gap_passes
from snapref_ray.render_service.judges.near_duplicate import near_duplicate_passes, score_near_duplicate
from snapref_ray.render_service.judges.sanity import sanity_passes, score_sanity
from snapref_ray.render_service.judges.scores import Judgement, JudgeScores
from snapref_ray.render_service.judges.spec import CheckName
from snapref_ray.render_service.references import Reference, RefKVKey
from snapref_ray.requests import RenderSettings

# Per check: does a render with these scores pass it (the threshold's one rule, also for a driver re-checking).
PASSES: dict[CheckName, Callable] = {
    "sanity": sanity_passes,
    "near_duplicate": near_duplicate_passes,
    "identity_gap": identity_gap_passes,
    "embedding": embedding_passes,
}

REFERENCE_FEATURES_CACHED = 256  # references whose embedding is kept (a few KB each)


@dataclass(frozen=True)
class JudgeTarget:
    """One rendered image and what its judges read of the render."""

    image: Image.Image
    prompt: str
    settings: RenderSettings  # as rendered
    latent_nonfinite: float | None  # fraction of the final latent not finite (None: not measured)


class Judges:
    """The checks of one render service (see the module docstring).

    `refkv_of(reference)` is the service's RefKV for a reference (its cache, or an encode, which takes
    the device itself); `device()` holds the device for the checks that run models.
    """

    def __init__(
        self,
        renderer,
        refkv_of: Callable[[Reference], object],
        device: Callable[[], AbstractContextManager],
    ) -> None:
        self.renderer = renderer
        self._refkv_of = refkv_of
        self._device = device
        self._embedders: dict[tuple[str, str], Embedder] = {}
        self._reference_feats: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def judge(self, targets: Sequence[JudgeTarget], call: JudgeCall, reference: Reference | None) -> list[Judgement]:
        """One `Judgement` per target: every asked check's scores, and its verdict."""
        check_call(call, reference is not None)
        scores: list[dict] = [{} for _ in targets]
        verdicts: list[dict[CheckName, bool]] = [{} for _ in targets]
        for name in call.spec.checks:
            check = getattr(call.spec, name)
            for mine, verdict, new in zip(scores, verdicts, self._score(name, check, targets, call, reference)):
                mine.update(new)
                verdict[name] = PASSES[name](new, check)
        return [Judgement.of(JudgeScores(**s), v) for s, v in zip(scores, verdicts)]

    def _score(self, name: CheckName, check, targets, call: JudgeCall, reference: Reference | None) -> list[dict]:
        images = [t.image for t in targets]
        if name == "sanity":
            return score_sanity(images, [t.latent_nonfinite for t in targets])
        if name == "near_duplicate":
            return score_near_duplicate(images, call.kept_phashes)
        if name == "identity_gap":
            return self._identity_gap(check, targets, reference, call.contrast)
        return self._embedding(check, images, reference)

    def _identity_gap(self, check, targets, reference: Reference, contrast: Reference) -> list[dict]:
        out = []
        for t in targets:
            # The contrast reference keyed for this render's size and caption: its RefKV must fit the target grid.
            other = dataclasses.replace(contrast, key=RefKVKey.for_settings(contrast.hash, t.settings))
            own_kv, other_kv = self._refkv_of(reference), self._refkv_of(other)  # each may encode (takes the device)
            with self._device():
                gap = identity_gap(self.renderer, t.image, t.prompt, t.settings, own_kv, other_kv, check)
            out.append({"identity_gap": gap})
        return out

    def _embedding(self, check, images, reference: Reference) -> list[dict]:
        key = (check.kind, check.model)
        ref_key = (*key, reference.hash)
        feats = self._reference_feats.get(ref_key)
        # The reference's files are read before the device is held (at the endpoint they come over the network).
        files = reference.load() if feats is None else None
        with self._device():
            embedder = self._embedders.get(key)
            if embedder is None:
                embedder = self._embedders[key] = load_embedder(check, self.renderer.device)
            if feats is None:
                feats = self._reference_feats[ref_key] = embedder.features(reference_images(files))
                while len(self._reference_feats) > REFERENCE_FEATURES_CACHED:
                    self._reference_feats.popitem(last=False)
            self._reference_feats.move_to_end(ref_key)
            return score_embedding(embedder, images, feats, reference.layout)
