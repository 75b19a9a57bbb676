import pytest

from ckptfmt import format as fmt


def test_size_law_matches_the_seed():
    assert fmt.file_size(0) == 8
    assert fmt.file_size(12_800_000) == 153_600_008          # ANDREA-12M, seed 000
    assert fmt.n_params_for_size(153_600_008) == 12_800_000
    assert fmt.n_params_for_size(153_600_009) is None
    assert fmt.n_params_for_size(7) is None


def test_region_offsets():
    assert [fmt.region_offset(r, 10) for r in fmt.REGIONS] == [8, 48, 88]


@pytest.mark.parametrize("step,name", [(0, "step_000000.bin"), (100, "step_000100.bin"),
                                       (999_999, "step_999999.bin"), (1_000_000, "step_1000000.bin"),
                                       (2**31 - 1, "step_2147483647.bin")])
def test_names_are_at_least_six_digits_and_never_truncated(step, name):
    assert fmt.checkpoint_name(step) == name
    assert fmt.parse_name(name) == (step, "bin")
    assert fmt.parse_name(name.replace(".bin", ".json")) == (step, "json")


@pytest.mark.parametrize("name", ["step_0000100.bin", "step_100.bin", "step_000100.bin.tmp", "Step_000100.bin",
                                  "step_-00001.bin", "step_000100.BIN", "xstep_000100.bin",
                                  ".ckptfmt-tmp.step_000100.bin.1.ab", "step_9999999999.bin"])
def test_look_alike_names_are_not_generations(name):
    assert fmt.parse_name(name) is None


def test_numeric_order_past_a_million():
    names = ["step_1000001.bin", "step_999998.bin", "step_1000000.bin", "step_999999.bin"]
    assert sorted(names, key=lambda n: fmt.parse_name(n)[0]) == [
        "step_999998.bin", "step_999999.bin", "step_1000000.bin", "step_1000001.bin"]


def test_header_packing_refuses_impossible_values():
    assert fmt.pack_header(3, 2) == bytes.fromhex("0300000002000000")
    for step, n in ((-1, 0), (0, -1), (2**31, 0), (0, 2**31)):
        with pytest.raises(ValueError):
            fmt.pack_header(step, n)
    assert fmt.unpack_header(bytes.fromhex("ffffffff00000080")) == (-1, -2**31)


def test_temp_names_never_match_the_checkpoint_pattern():
    from ckptfmt.atomic import temp_path_for
    temp = temp_path_for("/x/step_000100.bin")
    name = temp.rsplit("/", 1)[1]
    assert fmt.is_temp_name(name) and fmt.parse_name(name) is None
    assert not (name.startswith("step_") and name.endswith(".bin"))
