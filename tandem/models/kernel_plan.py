"""Which CPU kernel a projection (tandem.models.linear.Linear) runs for each row count: a frozen
value a model holds and gives every projection it owns. Imports no torch: the command line
builds one from --cpu-kernels ($TANDEM_CPU_KERNELS) and passes it down in the service's config."""

from dataclasses import dataclass

from tandem.errors import InvalidArgument

MAX_FLAT_ROWS = 3  # above this, the blocked copy where there is one
CPU_KERNELS = ("matvec", "flat", "blocked")  # W @ x^T (one row only), F.linear, oneDNN's blocked copy


@dataclass(frozen=True, slots=True)
class KernelPlan:
    by_rows: tuple[str, ...]  # the kernel for 1..MAX_FLAT_ROWS rows, names from CPU_KERNELS

    def __post_init__(self) -> None:
        if len(self.by_rows) != MAX_FLAT_ROWS or not set(self.by_rows) <= set(CPU_KERNELS):
            raise ValueError(f"a CPU kernel plan is {MAX_FLAT_ROWS} names of {CPU_KERNELS}, got {self.by_rows}")

    def kernel(self, rows: int) -> str:
        return "blocked" if rows > MAX_FLAT_ROWS else self.by_rows[rows - 1]

    def __str__(self) -> str:
        return ",".join(self.by_rows)


# An Intel Xeon's choice (tandem.models.linear says why): a model's plan until it times its own.
DEFAULT_PLAN = KernelPlan(("matvec", "flat", "flat"))


def plan_from_flag(text: str | None) -> KernelPlan | None:
    """--cpu-kernels ($TANDEM_CPU_KERNELS), e.g. "blocked,blocked,blocked": the same choice on
    every start; None or empty: None, the model times its own when it loads on CPU."""
    if not (text or "").strip():
        return None
    try:
        return KernelPlan(tuple(k.strip() for k in text.split(",")))
    except ValueError as e:
        raise InvalidArgument(f"--cpu-kernels (TANDEM_CPU_KERNELS): {e}") from None
