"""Element formats by name, shared by the spec tests: lowbit's and ml_dtypes' (where it has one)."""

import ml_dtypes

import lowbit as lb

LB_ELEMS = {
    "e4m3": lb.formats.E4M3,
    "e5m2": lb.formats.E5M2,
    "e3m2": lb.formats.E3M2,
    "e2m3": lb.formats.E2M3,
    "e2m1": lb.formats.E2M1,
    "int8": lb.formats.INT8,
    "int4": lb.formats.INT4,
    "ternary": lb.formats.TERNARY,
}
ML_DTYPES = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
}
