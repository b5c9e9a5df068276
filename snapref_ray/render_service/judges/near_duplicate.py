"""Near-duplicates within one reference's kept images: 64-bit pHash and Hamming distance.

A worker hashes each image it rendered (`imagehash.phash`: DCT of the 32x32 greyscale image, the 8x8
low frequencies against their median); the verdict needs the reference's kept set, which the caller
holds (a batch job's driver keeps 8 bytes an image) and passes in. `score_near_duplicate` is the
distance to the nearest kept hash, 64 (no bit in common is as far as it goes) when the set is empty;
the image is rejected at or below `max_distance`. `nearest_distance` is the same rule for a caller
that re-checks a batch's images against the ones it has just kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from PIL import Image

from snapref_ray.render_service.judges.spec import NearDuplicateCheck

HASH_BITS = 64


def phash(image: Image.Image) -> int:
    """The image's 64-bit perceptual hash as an unsigned int (bit order: imagehash's hex string)."""
    import imagehash

    return int(str(imagehash.phash(image)), 16)


def phash_hex(value: int) -> str:
    """16 hex digits, as `imagehash` prints a hash (and `JudgeScores.phash` holds it)."""
    return f"{value:016x}"


def parse_phash(text: str | int) -> int:
    """A hash given as 16 hex digits (or already an int) -> unsigned int; a ValueError names a bad one."""
    if isinstance(text, int):
        value = text
    else:
        try:
            value = int(text, 16)
        except ValueError:
            raise ValueError(f"a pHash is 16 hex digits, got {text!r}") from None
    if not 0 <= value < 2**HASH_BITS:
        raise ValueError(f"a pHash is 64 bits, got {text!r}")
    return value


def nearest_distance(value: int, kept: Sequence[int] | np.ndarray) -> int:
    """Hamming distance from `value` to the nearest hash in `kept`; 64 when `kept` is empty."""
    if len(kept) == 0:
        return HASH_BITS
    if len(kept) <= 32:
        return min((value ^ other).bit_count() for other in kept)
    # A large kept set (a quota of hundreds): one vectorised xor and popcount over its uint64 array.
    kept_u64 = np.asarray(kept, dtype=np.uint64)
    return int(np.bitwise_count(kept_u64 ^ np.uint64(value)).min())


def score_near_duplicate(images: Iterable[Image.Image], kept: Sequence[int]) -> list[dict[str, int | str]]:
    """Per image: `phash` (hex) and `near_duplicate`, its distance to the nearest of `kept`."""
    kept_u64 = np.asarray(kept, dtype=np.uint64) if len(kept) > 32 else list(kept)
    out = []
    for image in images:
        value = phash(image)
        out.append({"phash": phash_hex(value), "near_duplicate": nearest_distance(value, kept_u64)})
    return out


def near_duplicate_passes(scores: dict, check: NearDuplicateCheck) -> bool:
    """Kept unless within `max_distance` bits of an image already kept for its reference."""
    return scores["near_duplicate"] > check.max_distance
