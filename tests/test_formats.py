"""The format registry and the element-format constants of DESIGN.md ("Numerics" table).

Expected values are DESIGN.md's numbers, checked a second time against ml_dtypes and against
the code enumeration in tests/reference.py, so that a wrong table entry has to be wrong in
three independent places to go unnoticed.
"""

import ml_dtypes
import numpy as np
import pytest

import lowbit as lb
from tests import reference as ref
from tests.elements import LB_ELEMS, ML_DTYPES

# DESIGN.md "Format names": name -> (element, block size, scale format, tensor scale).
FORMATS = {
    "mxfp8_e4m3": ("e4m3", 32, "e8m0", False),
    "mxfp8_e5m2": ("e5m2", 32, "e8m0", False),
    "mxfp6_e2m3": ("e2m3", 32, "e8m0", False),
    "mxfp6_e3m2": ("e3m2", 32, "e8m0", False),
    "mxfp4": ("e2m1", 32, "e8m0", False),
    "mxint8": ("int8", 32, "e8m0", False),
    "nvfp4": ("e2m1", 16, "ue4m3", True),
    "int4": ("int4", 16, "ue4m3", True),
    "ternary": ("ternary", 5, "absmean", True),
}
ALIASES = {"mxfp8": "mxfp8_e4m3", "mxfp6": "mxfp6_e2m3"}

# DESIGN.md: element bits plus 8 scale bits per block (NVFP4's one float32 per tensor is
# amortised away).
BITS_PER_ELEMENT = {
    "mxfp4": 4.25,
    "nvfp4": 4.5,
    "mxfp6": 6.25,
    "mxfp6_e2m3": 6.25,
    "mxfp6_e3m2": 6.25,
    "mxfp8": 8.25,
    "mxfp8_e4m3": 8.25,
    "mxfp8_e5m2": 8.25,
    "mxint8": 8.25,
    "int4": 4.5,
    "ternary": 1.6,  # five codes a byte, no block scale
}

# DESIGN.md "Numerics" table: bits, max, smallest normal, smallest subnormal, emax.
ELEMENTS = {
    "e4m3": (8, 448.0, 2.0**-6, 2.0**-9, 8),
    "e5m2": (8, 57344.0, 2.0**-14, 2.0**-16, 15),
    "e3m2": (6, 28.0, 2.0**-2, 2.0**-4, 4),
    "e2m3": (6, 7.5, 2.0**0, 2.0**-3, 2),
    "e2m1": (4, 6.0, 2.0**0, 2.0**-1, 2),
}
INT8 = (8, 127.0 / 64.0, 2.0**-6, 0)  # bits, max, smallest positive value (2**-6), emax



# --------------------------------------------------------------------------------------------
# Registry


def test_names_are_exactly_the_design_formats():
    assert sorted(lb.formats.names()) == sorted(FORMATS)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_get_by_name(name):
    elem, block, scale, tensor_scale = FORMATS[name]
    fmt = lb.formats.get(name)
    assert isinstance(fmt, lb.BlockFormat)
    assert fmt.name == name
    assert fmt.elem is LB_ELEMS[elem]
    assert fmt.block_size == block
    assert fmt.scale.name == scale
    assert fmt.scale.bits == (0 if scale == "absmean" else 8)
    assert fmt.tensor_scale == tensor_scale
    assert fmt.is_mx == (scale == "e8m0")
    assert fmt.is_e4m3_scaled == (scale == "ue4m3")
    assert fmt.is_nvfp4 == (name == "nvfp4")
    assert fmt.is_absmean == (scale == "absmean")


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_aliases(alias):
    assert lb.formats.get(alias) is lb.formats.get(ALIASES[alias])
    assert lb.formats.get(alias).name == ALIASES[alias]


def test_aliases_are_not_listed_as_names():
    assert not set(ALIASES) & set(lb.formats.names())


@pytest.mark.parametrize("bad", ["mxfp5", "fp8", "", "nvfp4_e2m1", "mx fp4"])
def test_unknown_name_raises_value_error_listing_names(bad):
    with pytest.raises(ValueError) as info:
        lb.formats.get(bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in [*FORMATS, *ALIASES]:
        assert name in message


def test_block_format_passes_through_get():
    fmt = lb.formats.get("mxfp4")
    assert lb.formats.get(fmt) is fmt


@pytest.mark.parametrize("name", sorted(BITS_PER_ELEMENT))
def test_bits_per_element(name):
    assert lb.formats.get(name).bits_per_element == BITS_PER_ELEMENT[name]


# --------------------------------------------------------------------------------------------
# Element formats


@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_float_element_constants(name):
    bits, emax_value, min_normal, min_subnormal, emax = ELEMENTS[name]
    elem = LB_ELEMS[name]
    assert elem.bits == bits
    assert elem.max == emax_value
    assert elem.min_normal == min_normal
    assert elem.min_subnormal == min_subnormal
    assert elem.emax == emax
    assert 2.0**emax <= elem.max < 2.0 ** (emax + 1)  # emax is the largest binade


@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_float_element_constants_match_ml_dtypes_finfo(name):
    bits, emax_value, min_normal, min_subnormal, emax = ELEMENTS[name]
    fi = ml_dtypes.finfo(ML_DTYPES[name])
    assert fi.bits == bits
    assert float(fi.max) == emax_value
    assert float(fi.smallest_normal) == min_normal
    assert float(fi.smallest_subnormal) == min_subnormal
    assert fi.maxexp - 1 == emax
    assert fi.nmant == LB_ELEMS[name].mbits
    assert fi.nexp == LB_ELEMS[name].ebits


def test_int8_constants():
    bits, emax_value, smallest, emax = INT8
    elem = lb.formats.INT8
    assert elem.bits == bits
    assert elem.max == emax_value
    assert elem.min_subnormal == smallest
    assert elem.emax == emax
    assert elem.ml_dtype is None


@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_ml_dtype(name):
    assert LB_ELEMS[name].ml_dtype is ML_DTYPES[name]


def _ml_dtypes_positive_grid(dtype) -> np.ndarray:
    """Every non-negative finite value of an ml_dtypes type, from all of its codes."""
    nbits = ml_dtypes.finfo(dtype).bits
    vals = np.arange(2**nbits, dtype=np.uint8).view(dtype).astype(np.float64)
    vals = vals[np.isfinite(vals) & (vals >= 0)]
    return np.unique(vals)  # +0 and -0 collapse to one 0


@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_positive_grid_matches_ml_dtypes(name):
    grid = LB_ELEMS[name].positive_grid
    assert grid.dtype == np.float64
    np.testing.assert_array_equal(grid, _ml_dtypes_positive_grid(ML_DTYPES[name]))


@pytest.mark.parametrize("name", sorted(LB_ELEMS))
def test_positive_grid_matches_reference_enumeration(name):
    grid = LB_ELEMS[name].positive_grid
    expected, _ = ref.positive_grid(ref.ELEMS[name])
    np.testing.assert_array_equal(grid, expected)
    assert grid[0] == 0.0
    assert grid[-1] == LB_ELEMS[name].max
    assert grid[1] == LB_ELEMS[name].min_subnormal
    assert np.all(np.diff(grid) > 0)


def test_int8_positive_grid():
    np.testing.assert_array_equal(lb.formats.INT8.positive_grid, np.arange(128) / 64.0)


# Integer grids: bits, max, step, packed bits per code.
INTS = {"int4": (4, 7.0, 1.0, 4.0), "ternary": (2, 1.0, 1.0, 1.6), "int8_sym": (8, 127.0, 1.0, 8.0)}


@pytest.mark.parametrize("name", sorted(INTS))
def test_integer_grids(name):
    bits, top, step, packed = INTS[name]
    elem = {"int4": lb.formats.INT4, "ternary": lb.formats.TERNARY,
            "int8_sym": lb.formats.INT8_SYM}[name]
    assert elem.is_int and elem.bits == bits and elem.max == top
    assert elem.packed_bits == packed
    np.testing.assert_array_equal(elem.positive_grid, np.arange(0, top + step, step))
    # the nearest-even rounding every quantizer uses lands on this grid, ties to even
    v = np.concatenate([np.arange(-top, top + 0.25, 0.25), [0.5, 1.5, 2.5, -2.5]])
    v = v[np.abs(v) <= top].astype(np.float32)
    got = np.asarray(lb.numerics.round_to_grid(v, elem))
    np.testing.assert_array_equal(got, np.round(v))  # numpy: half to even
    assert not np.any(np.signbit(got) & (got == 0))  # two's complement: no -0


@pytest.mark.parametrize("name", sorted(ELEMENTS))
def test_reference_grid_matches_design_table(name):
    """The reference's enumeration reproduces the table (a check of the test oracle)."""
    _, emax_value, min_normal, min_subnormal, emax = ELEMENTS[name]
    r = ref.ELEMS[name]
    grid, _ = ref.positive_grid(r)
    assert r.max == emax_value
    assert grid[1] == min_subnormal
    assert grid[grid >= min_normal][0] == min_normal
    assert r.emax == emax
    vals = ref.code_values(r)
    np.testing.assert_array_equal(
        vals, np.arange(vals.size, dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float64)
    )


def test_reference_specials():
    e4m3 = ref.code_values(ref.ELEMS["e4m3"])
    assert np.flatnonzero(np.isnan(e4m3)).tolist() == [0x7F, 0xFF]  # S.1111.111 only
    e5m2 = ref.code_values(ref.ELEMS["e5m2"])
    assert np.flatnonzero(np.isinf(e5m2)).tolist() == [0x7C, 0xFC]
    assert np.flatnonzero(np.isnan(e5m2)).tolist() == [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]
    for name in ["e3m2", "e2m3", "e2m1"]:
        assert np.all(np.isfinite(ref.code_values(ref.ELEMS[name])))
