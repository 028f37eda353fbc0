"""A model by name: the name's syntax, and which file of a repository it means
(llama-server's -hf rules, vendor/llama.cpp common/download.cpp)."""

from __future__ import annotations

import pytest

from daemon.model.hub import (HubError, HubName, check_repo_file, choose_files, parse_hf_repo, pick_mmproj,
                              pick_model_file, quant_tag, split_parts)

GEMMA = ["README.md", "gemma-3-1b-it-Q4_K_M.gguf", "gemma-3-1b-it-Q8_0.gguf", "gemma-3-1b-it-f16.gguf",
         "mmproj-model-f16.gguf", "mmproj-model-Q8_0.gguf", "imatrix.gguf"]


@pytest.mark.parametrize("spec, repo, tag", [
    ("ggml-org/gemma-3-1b-it-GGUF", "ggml-org/gemma-3-1b-it-GGUF", None),
    ("ggml-org/gemma-3-1b-it-GGUF:Q4_K_M", "ggml-org/gemma-3-1b-it-GGUF", "Q4_K_M"),
    ("  unsloth/Qwen3-4B-GGUF:ud-q4_k_xl ", "unsloth/Qwen3-4B-GGUF", "ud-q4_k_xl"),
    ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q8_0", "bartowski/Llama-3.2-1B-Instruct-GGUF", "Q8_0"),
    ("a/b", "a/b", None),
])
def test_names_parse_as_llama_server_reads_them(spec, repo, tag):
    assert parse_hf_repo(spec) == HubName(repo, tag)


@pytest.mark.parametrize("spec", [
    "", "gemma", "a/b/c", "/b", "a/", "../etc/passwd", "owner/..", "owner/../x", "..owner/x", "own--er/x",
    "owner/name.git", "owner/na me", "owner/name\x00", "owner/naïve", "owner/name:", "owner/name:Q4:K",
    "owner/name:../x", "owner/name:" + "Q" * 65, "a" * 10_000, "x/" + "y" * 100, "-owner/x", "owner/x/",
    "https://huggingface.co/owner/x",
])
def test_hostile_names_are_refused_with_one_line(spec):
    with pytest.raises(HubError) as err:
        parse_hf_repo(spec)
    assert "\n" not in str(err.value)
    assert len(str(err.value)) < 400  # a huge name is not echoed back whole


@pytest.mark.parametrize("value", [None, 5, ["a/b"], {"a": "b"}, b"a/b"])
def test_a_name_that_is_not_text_is_refused(value):
    with pytest.raises(HubError, match="text"):
        parse_hf_repo(value)


@pytest.mark.parametrize("name", ["../x.gguf", "/etc/x.gguf", "a/../b.gguf", "a//b.gguf", "a\\b.gguf", "x.bin",
                                  "", "./x.gguf", "a" * 2000 + ".gguf", "x\n.gguf", 7])
def test_hostile_files_are_refused(name):
    with pytest.raises(HubError):
        check_repo_file(name)


def test_a_plain_file_path_passes():
    assert check_repo_file("Q4_K_M/model-Q4_K_M-00001-of-00002.gguf") == "Q4_K_M/model-Q4_K_M-00001-of-00002.gguf"


def test_no_tag_means_q4_k_m_then_q8_0_then_the_first():
    assert pick_model_file(GEMMA, None) == "gemma-3-1b-it-Q4_K_M.gguf"
    assert pick_model_file([f for f in GEMMA if "Q4_K_M" not in f], None) == "gemma-3-1b-it-Q8_0.gguf"
    assert pick_model_file(["README.md", "mmproj-f16.gguf", "x-BF16.gguf", "x-F32.gguf"], None) == "x-BF16.gguf"


def test_a_tag_matches_case_insensitively_and_never_picks_a_sidecar():
    assert pick_model_file(GEMMA, "q8_0") == "gemma-3-1b-it-Q8_0.gguf"
    assert pick_model_file(GEMMA, "F16") == "gemma-3-1b-it-f16.gguf"  # not mmproj-model-f16.gguf
    assert pick_model_file(GEMMA, "Q5_K_S") is None
    # the tag must be followed by '.' or '-': Q4_K does not pick Q4_K_M
    assert pick_model_file(GEMMA, "Q4_K") is None


def test_a_split_model_brings_every_part_and_is_picked_by_its_first():
    files = ["m-Q8_0-00002-of-00003.gguf", "m-Q8_0-00001-of-00003.gguf", "m-Q8_0-00003-of-00003.gguf",
             "m-Q4_K_M.gguf"]
    first = pick_model_file(files, "Q8_0")
    assert first == "m-Q8_0-00001-of-00003.gguf"
    assert split_parts(files, first) == ["m-Q8_0-00001-of-00003.gguf", "m-Q8_0-00002-of-00003.gguf",
                                         "m-Q8_0-00003-of-00003.gguf"]
    assert split_parts(files, "m-Q4_K_M.gguf") == ["m-Q4_K_M.gguf"]
    assert quant_tag("m-Q8_0-00002-of-00003.gguf") == "Q8_0"


def test_the_projector_nearest_the_models_quantization_comes_along():
    assert pick_mmproj(GEMMA, "gemma-3-1b-it-Q8_0.gguf") == "mmproj-model-Q8_0.gguf"
    assert pick_mmproj(GEMMA, "gemma-3-1b-it-f16.gguf") == "mmproj-model-f16.gguf"
    assert pick_mmproj(["a.gguf"], "a.gguf") is None
    # in the model's directory or above, never in another one; the deepest wins
    files = ["Q4/m-Q4_K_M.gguf", "other/mmproj-f16.gguf", "mmproj-f32.gguf", "Q4/mmproj-f16.gguf"]
    assert pick_mmproj(files, "Q4/m-Q4_K_M.gguf") == "Q4/mmproj-f16.gguf"
    assert pick_mmproj(files[:3], "Q4/m-Q4_K_M.gguf") == "mmproj-f32.gguf"


def test_an_unmatched_tag_lists_the_quants_there_are():
    with pytest.raises(HubError) as err:
        choose_files(HubName("ggml-org/gemma-3-1b-it-GGUF", "Q5_K_S"), GEMMA, None)
    message = str(err.value)
    assert "Q5_K_S" in message and "Q4_K_M, Q8_0, F16" in message
    assert "ggml-org/gemma-3-1b-it-GGUF:Q4_K_M" in message
    assert "mmproj" not in message and "imatrix" not in message  # sidecars are not offered as quants


def test_a_repository_without_gguf_says_so():
    with pytest.raises(HubError, match="holds no GGUF model file.*config.json"):
        choose_files(HubName("google/gemma-3-1b-it", None), ["config.json", "model.safetensors"], None)


def test_an_explicit_file_must_be_in_the_repository():
    assert choose_files(HubName("o/r", None), GEMMA, "gemma-3-1b-it-f16.gguf") == (
        ["gemma-3-1b-it-f16.gguf"], "mmproj-model-f16.gguf")
    with pytest.raises(HubError, match="no file 'nope.gguf'.*gemma-3-1b-it-Q4_K_M.gguf"):
        choose_files(HubName("o/r", None), GEMMA, "nope.gguf")


def test_a_long_listing_is_cut():
    files = [f"m-Q{i}_0.gguf" for i in range(100)]
    with pytest.raises(HubError) as err:
        choose_files(HubName("o/r", "Q999"), files, None)
    assert "and 80 more" in str(err.value)
