"""Calibration and evaluation data sources, validated against the model before any work.

Three forms, chosen by what the user gives:

- ``data.npz``: one array per graph input, axis 0 indexes samples (see "Layouts" below). Extra arrays (labels,
  ids) are allowed and not fed; they may have any sample count.
- ``folder/``: every ``*.npz`` (one array per input) or ``*.npy`` (single-input models) file is one sample,
  in file-name order; a sample may leave out the model's batch axis of size 1.
- ``package.module:function``: a Python callable returning an iterable of feed dicts. Preprocessing is the
  callable's job; qgraph does not guess.

Layouts (``--data-layout``), for an input of rank r and a stacked array of rank a (axis 0 = samples):

- ``samples``: sample i is ``arr[i]``; when it has rank r - 1 (the batch axis left out) an axis of size 1 is
  inserted where the model's batch axis is: the first axis whose size is symbolic or 1 (``state[2, batch, 128]``
  stored as ``(N, 2, 128)`` feeds ``(2, 1, 128)``; a scalar input stored as ``(N,)`` feeds 0-d values);
- ``batched``: the array's axis 0 is the model's batch axis: sample i is ``arr[i:i+1]`` (a == r);
- ``auto`` (default): ``samples`` when a == r + 1 or when axis 0 of the input is a fixed size other than 1;
  otherwise (a == r, axis 0 symbolic or 1) the two layouts feed the same arrays and ``batched`` is reported. A
  0-d array is one sample of a scalar input. Every choice that adds a batch axis is listed in the run summary.

Every source yields feed dicts ``{input_name: array}`` (one sample each, or the callable's own batches), can be
iterated more than once (histogram calibration reads the data twice) and is checked for names, dtypes, ranks,
static dimensions and non-finite values with a `DataError` that says which sample, which input, and the fix.
"""

from __future__ import annotations

from .batches import Batches, batched
from .inputs import (
    DEFAULT_MAX_SAMPLES,
    DataLayout,
    Feed,
    InputSpec,
    LayoutChoice,
    check_array,
    decide_layout,
    exact_array,
    model_inputs,
    plain_value_problem,
)
from .sources import (
    CallableSource,
    DataSource,
    DataSpec,
    FixedInputs,
    FolderSource,
    NpzSource,
    open_data_source,
    without_fixed_inputs,
)
from .user_code import import_callable, user_code

__all__ = [
    "DEFAULT_MAX_SAMPLES",
    "Batches",
    "CallableSource",
    "DataLayout",
    "DataSource",
    "DataSpec",
    "Feed",
    "FixedInputs",
    "FolderSource",
    "InputSpec",
    "LayoutChoice",
    "NpzSource",
    "batched",
    "check_array",
    "decide_layout",
    "exact_array",
    "import_callable",
    "model_inputs",
    "open_data_source",
    "plain_value_problem",
    "user_code",
    "without_fixed_inputs",
]
