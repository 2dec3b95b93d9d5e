"""ONNX element types seen from torch: storage dtypes, integer grids and tensor conversion.

torch lacks arithmetic on some ONNX integer types, so they are held widened: uint16 in int32, uint32 and uint64 in
int64, int4/uint4 in int8/uint8. 8-bit float tensors (FP8 codes) are held as float32 values, which is exact.
"""
from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto as T
from onnx import numpy_helper

STORAGE: dict[int, torch.dtype] = {
    T.FLOAT: torch.float32, T.DOUBLE: torch.float64, T.FLOAT16: torch.float16, T.BFLOAT16: torch.bfloat16,
    T.INT8: torch.int8, T.UINT8: torch.uint8, T.INT16: torch.int16, T.UINT16: torch.int32,
    T.INT32: torch.int32, T.UINT32: torch.int64, T.INT64: torch.int64, T.UINT64: torch.int64,
    T.BOOL: torch.bool, T.INT4: torch.int8, T.UINT4: torch.uint8,
    T.FLOAT8E4M3FN: torch.float32, T.FLOAT8E4M3FNUZ: torch.float32, T.FLOAT8E5M2: torch.float32,
    T.FLOAT8E5M2FNUZ: torch.float32,
}

# Integer grids of QuantizeLinear outputs.
INT_RANGE: dict[int, tuple[int, int]] = {
    T.INT8: (-128, 127), T.UINT8: (0, 255), T.INT16: (-32768, 32767), T.UINT16: (0, 65535),
    T.INT4: (-8, 7), T.UINT4: (0, 15), T.INT32: (-2**31, 2**31 - 1),
}

# 8-bit float grids: largest finite value and the torch dtype that rounds to it (ONNX saturate=1 clamps first).
FLOAT8: dict[int, tuple[float, torch.dtype]] = {
    T.FLOAT8E4M3FN: (448.0, torch.float8_e4m3fn), T.FLOAT8E5M2: (57344.0, torch.float8_e5m2),
    T.FLOAT8E4M3FNUZ: (240.0, torch.float8_e4m3fnuz), T.FLOAT8E5M2FNUZ: (57344.0, torch.float8_e5m2fnuz),
}

FLOAT_TYPES = {T.FLOAT, T.DOUBLE, T.FLOAT16, T.BFLOAT16}


def name(elem_type: int | None) -> str:
    return T.DataType.Name(elem_type) if elem_type else "unknown"


def storage(elem_type: int) -> torch.dtype:
    try:
        return STORAGE[elem_type]
    except KeyError:
        raise TypeError(f"element type {name(elem_type)} has no torch counterpart") from None


def is_float_type(elem_type: int | None) -> bool:
    return elem_type in FLOAT_TYPES


def tensor_from_proto(proto: onnx.TensorProto) -> torch.Tensor:
    """A TensorProto as a torch tensor in its storage dtype (an owned copy)."""
    if proto.data_type == T.STRING:
        raise TypeError(f"string tensor {proto.name!r} has no torch counterpart")
    return tensor_from_numpy(numpy_helper.to_array(proto), proto.data_type)


def tensor_from_numpy(array: np.ndarray, elem_type: int | None = None) -> torch.Tensor:
    if elem_type is None:
        return torch.from_numpy(np.array(array, copy=True))
    target = storage(elem_type)
    if target in (torch.float32, torch.float64, torch.float16) and array.dtype.kind not in "f":
        array = array.astype(np.float32)  # FP8 / bfloat16 (ml_dtypes) values, exact in float32
    elif target == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array.astype(np.float32))).to(torch.bfloat16)
    if elem_type in (T.INT4, T.UINT4):
        array = array.astype(np.int8 if elem_type == T.INT4 else np.uint8)  # ml_dtypes int4 / uint4
    if target == torch.int32 and array.dtype == np.uint16:
        array = array.astype(np.int32)
    if target == torch.int64 and array.dtype in (np.uint32, np.uint64):
        array = array.astype(np.int64)
    return torch.from_numpy(np.array(array, copy=True)).to(target)


def elem_type_of(dtype: torch.dtype) -> int:
    """The ONNX element type a torch dtype stands for (the inverse of STORAGE for the unwidened types)."""
    for t in (T.FLOAT, T.DOUBLE, T.FLOAT16, T.BFLOAT16, T.INT8, T.UINT8, T.INT16, T.INT32, T.INT64, T.BOOL):
        if STORAGE[t] == dtype:
            return t
    raise TypeError(f"torch dtype {dtype} has no ONNX element type")
