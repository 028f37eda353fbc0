"""-ub with --embeddings reads as llama-server reads it: the batch becomes the micro-batch (issue 29).

llama-server lowers n_batch to n_ubatch when embeddings are on (a pooled input must sit in one
micro-batch); Dormouse's embeddings context reads in micro-batches of batch_size, so the translation
folds -ub into batch_size instead of refusing the command line (llama.cpp's own embedding tests pass
`--batch-size 128 --ubatch-size 128 --embedding` on every start)."""

from __future__ import annotations

import pytest

from daemon.llama_server_args import LLAMA_SERVER_N_BATCH, LlamaServerArgsError, translate

NO_DORMOUSE_FLAGS: dict[str, bool] = {}


@pytest.mark.parametrize("argv, batch_size", [
    (["--embedding", "-b", "128", "-ub", "128"], 128),      # equal: kept as it is
    (["--embedding", "-b", "300", "-ub", "128"], 128),      # -b above -ub: lowered to -ub
    (["--embedding", "-ub", "256"], 256),                    # -b left out: llama-server's 2048 lowered to -ub
    (["-ub", "64", "--embeddings", "--batch-size", "32"], 32),  # -b below -ub: llama.cpp caps -ub at -b
])
def test_ubatch_with_embeddings_becomes_the_batch_size(argv, batch_size):
    t = translate(argv, {}, NO_DORMOUSE_FLAGS)
    assert t.settings["batch_size"] == batch_size
    assert "n_ubatch" not in t.llama_options  # the worker refuses n_ubatch on an embeddings model


def test_lowering_the_batch_is_said_in_a_note():
    t = translate(["--embedding", "-ub", "100"], {}, NO_DORMOUSE_FLAGS)
    assert any("lowered to 100" in note and str(LLAMA_SERVER_N_BATCH) in note for note in t.notes)


def test_the_variables_fold_the_same_way():
    t = translate([], {"LLAMA_ARG_EMBEDDINGS": "1", "LLAMA_ARG_UBATCH": "96", "LLAMA_ARG_BATCH": "512"},
                  NO_DORMOUSE_FLAGS)
    assert t.settings["batch_size"] == 96 and "n_ubatch" not in t.llama_options


def test_ubatch_without_embeddings_still_reaches_llama_cpp():
    t = translate(["-ub", "64", "-b", "256"], {}, NO_DORMOUSE_FLAGS)
    assert t.llama_options["n_ubatch"] == 64 and t.settings["batch_size"] == 256


@pytest.mark.parametrize("value", ["0", "-5", "huge", "9" * 30])
def test_a_bad_ubatch_is_refused_with_its_name(value):
    with pytest.raises(LlamaServerArgsError, match="-ub"):
        translate(["--embedding", "-ub", value], {}, NO_DORMOUSE_FLAGS)
