"""Every numeric flag is range-checked before any work, and a path that cannot serve its role is refused:
one line `train.py: error: ...`, exit 2, nothing written (train.main in this process: no ranks, no data read
past validation). Whole-run and multi-rank bad-input cases are in test_train.py, test_pipeline_train.py and
test_zero.py."""

import os
import tempfile
import unittest
from unittest import mock

from tests.harness import expect_train_error_in_process, make_token_bins
from trainer import config
from trainer.config import train_parser

BASE = ["--model", "tiny", "--micro_batch_size", "2", "--seq_len", "32", "--total_batch_size", "64", "--max_steps", "2"]

# Every int and float option of train.py's parser but --seed (any int seeds), with its valid range: the one
# table the cases below are generated from. A numeric option the parser gains must be added here.
RANGES = {
    **dict.fromkeys(
        [
            "--tensor_parallel_size",
            "--data_parallel_size",
            "--data_parallel_replicate_size",
            "--pipeline_parallel_size",
            "--pp_virtual_stages",
            "--context_parallel_size",
            "--ac_every",
            "--n_layer",
            "--n_head",
            "--n_embd",
            "--block_size",
            "--vocab_size",
            "--micro_batch_size",
            "--seq_len",
            "--total_batch_size",
            "--max_steps",
            "--eval_interval",
            "--eval_iters",
            "--keep_checkpoints",
            "--trace_step",
            "--expert_parallel_size",
            "--moe_top_k",
            "--moe_every",
            "--muon_ns_steps",
            "--ft_replica_groups",
        ],
        ">= 1",
    ),
    **dict.fromkeys(
        [
            "--warmup_steps",
            "--checkpoint_interval",
            "--profile",
            "--moe_num_experts",
            "--moe_ffn_hidden",
            "--ft_replica_group",
        ],
        ">= 0",
    ),
    **dict.fromkeys(
        ["--lr", "--timeout", "--bucket_cap_mb", "--peak_flops", "--muon_lr", "--ft_timeout", "--ft_connect_timeout"],
        "> 0",
    ),  # floats, finite
    **dict.fromkeys(
        ["--weight_decay", "--moe_aux_loss_coeff", "--moe_bias_update_rate", "--muon_weight_decay", "--muon_momentum"],
        ">= 0",
    ),  # floats, finite (--muon_momentum < 1: optim/flags.py)
}
# --seed takes any int; the simulated rank's pair (0 <= rank < N, N >= 1, both or neither) is one check of its own,
# config._check_fake, held by tests/test_verify.TestFlags
UNRANGED = {"--seed", "--fake_world_size", "--fake_rank"}


def numeric_options() -> dict[str, type]:
    """Every option of train.py's parser whose type is int or float: flag -> type."""
    return {a.option_strings[0]: a.type for a in train_parser()._actions if a.type in (int, float)}


def range_cases() -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    """From RANGES: (flag, out-of-range value) -> the message config gives, and flag -> its lowest valid value."""
    bad, lowest, kinds = {}, {}, numeric_options()
    for flag, rule in RANGES.items():
        if kinds[flag] is int:
            low = int(rule.split()[1])
            bad[(flag, str(low - 1))] = f"{flag} must be >= {low}, got {low - 1}"
            lowest[flag] = str(low)
        else:
            values = ("0", "-1", "nan", "inf", "-inf") if rule == "> 0" else ("-1", "nan", "inf", "-inf")
            for v in values:
                bad[(flag, v)] = f"{flag} must be a finite number {rule}, got {float(v)}"
            lowest[flag] = "5e-324" if rule == "> 0" else "0"  # the smallest positive double, or 0
    return bad, lowest


# flag value -> the words the one line must contain (beyond the generated range cases)
CASES = {
    ("--lr", "fast"): "argument --lr: invalid float value: 'fast'",
    ("--micro_batch_size", "2.5"): "argument --micro_batch_size: invalid int value: '2.5'",
    ("--activation_checkpointing", "some"): "argument --activation_checkpointing: invalid choice",
    ("--trace_step", "3"): "--trace_step 3 is past --max_steps 2",
}


class TestRangesAndPaths(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.data = make_token_bins(os.path.join(cls.tmp.name, "data"), n_train=2000, n_val=500)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_every_numeric_option_has_a_range(self):
        """The table covers the parser: a new int or float option fails here until its range is written down."""
        self.assertEqual(set(numeric_options()) - UNRANGED, set(RANGES))

    def test_out_of_range_values_are_refused(self):
        bad, _ = range_cases()
        for i, ((flag, value), words) in enumerate({**bad, **CASES}.items()):
            with self.subTest(f"{flag} {value}"):  # an out_dir each: a value wrongly let through fails only its case
                expect_train_error_in_process(
                    self,
                    [*BASE, "--dataset", self.data, f"{flag}={value}"],
                    words,
                    os.path.join(self.tmp.name, f"out_{i}"),
                )

    def test_lowest_valid_value_passes_the_range_check(self):
        """The bound is the table's, not stricter: validate may refuse the value for another reason (seq_len >
        block_size 1, ...), never with the range check's `--flag must be`."""
        _, lowest = range_cases()
        for flag, value in lowest.items():
            with self.subTest(f"{flag} {value}"), mock.patch.dict(os.environ, clear=True):  # one rank
                args = config.parse_args(
                    [
                        *BASE,
                        "--dataset",
                        self.data,
                        f"{flag}={value}",
                        "--out_dir",
                        os.path.join(self.tmp.name, "lowest"),
                        "--device",
                        "cpu",
                    ]
                )
                try:
                    config.validate(args)
                except config.UsageError as e:
                    self.assertNotIn(f"{flag} must be", str(e))

    def test_out_dir_that_is_a_file(self):
        path = os.path.join(self.tmp.name, "a_file")
        open(path, "w").write("not a directory")
        expect_train_error_in_process(
            self, [*BASE, "--dataset", self.data], "is a file, not a directory", path, fresh=False
        )
        self.assertTrue(os.path.isfile(path))  # untouched

    def test_dataset_that_is_a_file(self):
        expect_train_error_in_process(
            self,
            [*BASE, "--dataset", os.path.join(self.data, "train.bin")],
            "dataset",
            os.path.join(self.tmp.name, "out"),
        )


if __name__ == "__main__":
    unittest.main()
