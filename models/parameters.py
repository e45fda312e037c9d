"""Empty parameters on the target device and dtype, which the loader fills in place."""

import torch


def empty_parameter(shape, dtype: torch.dtype, device) -> torch.nn.Parameter:
    """An uninitialized ``Parameter`` of ``shape`` (no host copy, no init pass, no gradient)."""
    return torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def optional_parameter(present: bool, shape, dtype: torch.dtype,
                       device) -> torch.nn.Parameter | None:
    """``empty_parameter`` when ``present``, else None (a weight the config leaves out)."""
    return empty_parameter(shape, dtype, device) if present else None
