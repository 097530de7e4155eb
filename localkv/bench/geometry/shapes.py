"""The cache geometry of three real models, and what storing it once costs.

Only what a model keeps per sequence is real here: how many layers attend,
over how many tokens (full or a sliding window), with how many KV heads of
how many dimensions, and the size of a recurrent layer's state. The residual
stream, the FFN and the query heads are narrow (``models``), since they do
not change a byte of the cache.

- **Llama 3.1 8B**: 32 layers, all full attention, 8 KV heads x 128 dims.
- **Gemma 3 12B**: 48 layers; five of every six slide over 1,024 tokens, every
  sixth is global (llama.cpp's gemma3 pattern); 8 KV heads x 256 dims.
- **Granite 4.0-H-Tiny** (``granitehybrid`` in llama.cpp; its GGUF and
  ``config.json``): 40 layers, attention in layers 5, 15, 25 and 35 with 4 KV
  heads x 128 dims (12 query heads over a 1,536 stream), the other 36 Mamba2
  layers with an inner size of 3,072, 48 heads, state size 128, one group,
  convolution kernel 4. It is written as llama.cpp's ``nemotron_h``, whose
  loader takes the same Mamba2 and attention layers (a memory of the same
  shapes); Granite's MoE FFN keeps nothing per sequence and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GEOMETRIES", "Geometry", "Ssm", "by_name"]

F16 = 2  # bytes of a K or V element: llama.cpp's default cache type
F32 = 4  # bytes of a recurrent state element


@dataclass(frozen=True, slots=True, kw_only=True)
class Ssm:
    """A Mamba2 layer's shape."""

    d_inner: int
    d_state: int
    n_head: int
    n_group: int = 1
    d_conv: int = 4

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_group * self.d_state

    @property
    def state_bytes(self) -> int:
        """One layer's recurrent state: the convolution's last inputs and the SSM state."""
        return ((self.d_conv - 1) * self.conv_dim + self.d_state * self.d_inner) * F32


@dataclass(frozen=True, slots=True, kw_only=True)
class Geometry:
    """What one model keeps per sequence, layer by layer."""

    name: str  # a file-name-safe key
    label: str  # the model whose geometry this is
    arch: str  # the GGUF architecture written
    kinds: tuple[str, ...]  # per layer: "full", "swa" or "ssm"
    n_head_kv: int
    head_dim: int
    window: int = 0  # the sliding window of "swa" layers
    ssm: Ssm | None = None

    def __post_init__(self) -> None:
        if not self.kinds or set(self.kinds) - {"full", "swa", "ssm"}:
            raise ValueError(f"{self.name}: layer kinds must be full, swa or ssm")
        if ("swa" in self.kinds) != (self.window > 0):
            raise ValueError(f"{self.name}: sliding layers need a window, and only they")
        if ("ssm" in self.kinds) != (self.ssm is not None):
            raise ValueError(f"{self.name}: recurrent layers need an Ssm shape, and only they")

    @property
    def n_layer(self) -> int:
        return len(self.kinds)

    def count(self, kind: str) -> int:
        return self.kinds.count(kind)

    @property
    def row_bytes(self) -> int:
        """One token's K and V rows in one attention layer (f16)."""
        return 2 * self.n_head_kv * self.head_dim * F16

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's K and V rows in every attention layer, full and sliding."""
        return self.row_bytes * (self.count("full") + self.count("swa"))

    @property
    def recurrent_bytes(self) -> int:
        """The whole recurrent state of one sequence (0 without recurrent layers)."""
        return self.ssm.state_bytes * self.count("ssm") if self.ssm else 0

    def rows_once(self, n_tokens: int) -> int:
        """Every K/V row of ``n_tokens`` in every layer once, plus one recurrent state."""
        return n_tokens * self.kv_bytes_per_token + self.recurrent_bytes


def _gemma3_kinds(n_layer: int) -> tuple[str, ...]:
    return tuple("full" if (i + 1) % 6 == 0 else "swa" for i in range(n_layer))


def _granite_kinds() -> tuple[str, ...]:
    return tuple("full" if i in (5, 15, 25, 35) else "ssm" for i in range(40))


GEOMETRIES = (
    Geometry(
        name="gemma-3-12b",
        label="Gemma 3 12B",
        arch="gemma3",
        kinds=_gemma3_kinds(48),
        n_head_kv=8,
        head_dim=256,
        window=1024,
    ),
    Geometry(
        name="llama-3.1-8b",
        label="Llama 3.1 8B",
        arch="llama",
        kinds=("full",) * 32,
        n_head_kv=8,
        head_dim=128,
    ),
    Geometry(
        name="granite-4.0-h-tiny",
        label="Granite 4.0-H-Tiny",
        arch="nemotron_h",
        kinds=_granite_kinds(),
        n_head_kv=4,
        head_dim=128,
        ssm=Ssm(d_inner=3072, d_state=128, n_head=48),
    ),
)


def by_name(name: str) -> Geometry:
    for g in GEOMETRIES:
        if g.name == name:
            return g
    raise ValueError(f"unknown geometry {name!r}; one of {', '.join(g.name for g in GEOMETRIES)}")
