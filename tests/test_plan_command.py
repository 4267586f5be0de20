"""``slide plan``: the plan of a recipe from its config alone, for a machine given by flags."""

import json
import shlex

import pytest

from lightning_slide.engine import machine
from lightning_slide.plan_command import plan

QUICKSTART = ["--config", "recipes/quickstart.yaml"]
KEYS = {"fits", "schedule", "gpu_bytes", "host_bytes", "disk_bytes", "predicted_step_s", "units"}


@pytest.fixture
def config_dir(tmp_path):
    # a directory holding only a config.json: a Llama of 1.2 B parameters (none of them made)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.fixture(autouse=True)
def _no_machine(monkeypatch):
    # every figure comes from the flags: reading this machine is an error
    def refuse(*args):
        raise AssertionError("slide plan read this machine")

    for name in ("available_host_bytes", "locked_memory_limit", "device_budget"):
        monkeypatch.setattr(machine, name, refuse)
    monkeypatch.setenv("SLIDE_NVME_PATH", "/nonexistent")  # not the planned machine's disk


def _run(capsys, args):
    status = plan(args)
    return status, capsys.readouterr().out


def test_a_small_recipe_fits_whole_on_the_gpu_and_the_json_is_all_of_stdout(capsys):
    status, out = _run(capsys, [*QUICKSTART, "--gpu-memory", "24", "--host-memory", "64", "--json"])
    result = json.loads(out)  # nothing else on stdout
    assert status == 0
    assert set(result) >= KEYS
    assert result["fits"] is True
    assert result["placement"] == "resident"
    assert {(u["weights"], u["optimizer"]) for u in result["units"]} == {("gpu", "gpu")}
    assert (
        sum(u["params"] for u in result["units"]) == 2 * 262 * 128 + 4 * 181_504 + 128
    )  # embedding, head, blocks, norm
    assert result["predicted_step_s"] > 0


def test_a_model_from_a_config_directory_streams_or_stops_with_the_shortfall(capsys, config_dir):
    model = [
        "--model.config",
        "null",
        "--model.model",
        config_dir,
        "--trainer.precision",
        "bf16-mixed",
        "--data.seq_len",
        "4096",
    ]
    status, out = _run(capsys, [*QUICKSTART, *model, "--gpu-memory", "24", "--host-memory", "64", "--json"])
    result = json.loads(out)
    assert status == 0
    assert result["placement"] == "stream"
    blocks = [u for u in result["units"] if ".layers." in u["name"]]
    assert len(blocks) == 16
    assert (blocks[-1]["weights"], blocks[-1]["optimizer"]) == ("stream", "cpu")  # the GPU tier keeps the first ones
    assert {(u["weights"], u["optimizer"]) for u in result["units"]} <= {("stream", "cpu"), ("gpu", "gpu")}
    streamed = sum(u["params"] for u in result["units"] if u["weights"] == "stream")
    assert result["host_bytes"] > streamed * 12  # fp32 masters and Adam's moments of what streams
    # 16 GiB of RAM: does not fit, and the text says by how much and what helps
    status, out = _run(capsys, [*QUICKSTART, *model, "--gpu-memory", "24", "--host-memory", "16"])
    assert status == 1
    assert "does not fit: SlideFormer needs" in out
    assert "Move the optimizer state to disk" in out
    # with an NVMe disk, the optimizer state goes there and the run fits
    status, out = _run(capsys, [*QUICKSTART, *model, "--gpu-memory", "24", "--host-memory", "16", "--nvme-free", "500",
                                "--json"])  # fmt: skip
    result = json.loads(out)
    assert status == 0
    assert {u["optimizer"] for u in result["units"] if u["weights"] == "stream"} == {"nvme"}
    assert result["disk_bytes"] >= sum(u["params"] for u in result["units"] if u["weights"] == "stream") * 8


def test_rates_from_flags_change_the_predicted_step(capsys, config_dir):
    args = [
        *QUICKSTART,
        "--model.config",
        "null",
        "--model.model",
        config_dir,
        "--gpu-memory",
        "24",
        "--host-memory",
        "64",
        "--json",
    ]
    _, out = _run(capsys, args)
    _, slower = _run(capsys, [*args, "--rate-cpu-params-per-s", "1e8"])
    assert json.loads(slower)["predicted_step_s"] > 5 * json.loads(out)["predicted_step_s"]


@pytest.mark.parametrize(("precision", "bf16_grads"), [("bf16-mixed", True), ("32-true", False)])
def test_bf16_state_under_a_bf16_compute_is_predicted_at_the_bf16_gradients_rate(
    capsys, config_dir, precision, bf16_grads
):
    args = [*QUICKSTART, "--model.config", "null", "--model.model", config_dir, "--trainer.precision", precision,
            "--trainer.strategy.init_args.optimizer_state", "bf16", "--gpu-memory", "24", "--host-memory", "64",
            "--json"]  # fmt: skip
    step = json.loads(_run(capsys, args)[1])["predicted_step_s"]
    slower = {flag: json.loads(_run(capsys, [*args, flag, "1e8"])[1])["predicted_step_s"] / step
              for flag in ("--rate-cpu-bf16-grad-params-per-s", "--rate-cpu-bf16-params-per-s")}  # fmt: skip
    # an fp32 compute's gradients are fp32: read at the rate of bf16 moments with fp32 gradients
    read, unread = slower.values() if bf16_grads else reversed(slower.values())
    assert read > 5
    assert unread == 1


def test_an_nvme_recipe_without_a_disk_does_not_fit_and_says_so(capsys, config_dir):
    args = ["--config", "recipes/llama3_1_8b_full_nvme.yaml", "--model.model", config_dir, "--gpu-memory", "24",
            "--host-memory", "64"]  # fmt: skip
    status, out = _run(capsys, [*args, "--json"])
    assert status == 1
    assert json.loads(out) == {"fits": False, "reason": json.loads(out)["reason"]}
    assert "nvme_path" in json.loads(out)["reason"] or "SLIDE_NVME_PATH" in json.loads(out)["reason"]
    status, out = _run(capsys, [*args, "--nvme-free", "500", "--json"])
    assert status == 0
    assert {u["optimizer"] for u in json.loads(out)["units"]} == {"nvme"}


def test_activations_beyond_the_gpu_stop_with_the_shortfall_or_are_offloaded(capsys, config_dir):
    args = [*QUICKSTART, "--model.config", "null", "--model.model", config_dir, "--trainer.precision", "bf16-mixed",
            "--data.seq_len", "4096", "--data.batch_size", "8", "--gpu-memory", "9", "--host-memory", "64"]  # fmt: skip
    status, out = _run(capsys, [*args, "--trainer.strategy.init_args.offload_activations", "false"])
    assert status == 1
    assert "of device memory at 32768 tokens per batch" in out
    assert "GiB more than the 8.50 GiB it may use: keep every block's input in RAM" in out
    status, out = _run(capsys, [*args, "--json"])  # "auto": the first blocks' inputs go to RAM instead
    result = json.loads(out)
    assert status == 0
    assert 0 < result["offloaded_blocks"] < 16
    assert result["gpu_bytes"] <= 8.5 * 2**30


def test_the_processes_of_a_node_each_plan_on_their_share_and_hold_the_state_once(capsys, config_dir):
    args = [*QUICKSTART, "--model.config", "null", "--model.model", config_dir, "--trainer.precision", "bf16-mixed",
            "--data.seq_len", "4096", "--gpu-memory", "24", "--json"]  # fmt: skip
    _, out = _run(capsys, [*args, "--host-memory", "64"])
    one = json.loads(out)
    _, out = _run(capsys, [*args, "--host-memory", "64", "--trainer.devices", "2"])
    two = json.loads(out)
    assert (one["processes"], two["processes"]) == (1, 2)
    assert one["gpu_bytes"] == two["gpu_bytes"]  # each GPU runs what one runs alone
    # the node's figure: the masters and Adam's state once, each process's landing buffers and its move of its share
    # of the masters into the shared memory
    assert one["host_bytes"] < two["host_bytes"] < 2 * one["host_bytes"]
    # RAM that fits one process need not fit two (22 GiB: one fits from 21, two from 23; each process brings the
    # state of the units its GPU keeps to the host after fit)
    status, out = _run(capsys, [*args, "--host-memory", "22"])
    assert status == 0
    status, out = _run(capsys, [*args, "--host-memory", "22", "--trainer.devices", "2"])
    assert status == 1
    assert "each of this node's 2 processes' figures" in json.loads(out)["reason"]
    # the first process alone loads the model (4.5 GiB in fp32); two fit from 23 GiB
    status, out = _run(capsys, [*args, "--host-memory", "23", "--trainer.devices", "2"])
    assert status == 0
    # on NVMe, each process's files hold its rows' state: the node's disk holds it once too
    nvme = [*args, "--host-memory", "64", "--nvme-free", "500"]
    nvme += ["--trainer.strategy.init_args.optimizer_offload", "nvme"]
    disk = [json.loads(_run(capsys, [*nvme, "--trainer.devices", str(n)])[1])["disk_bytes"] for n in (1, 2)]
    assert disk[0] > 8 * 10**9
    assert disk[1] == pytest.approx(disk[0], rel=1e-6)


def test_clipping_on_a_short_host_keeps_units_on_the_gpu_rather_than_running_a_second_backward(capsys, config_dir):
    args = [*QUICKSTART, "--model.config", "null", "--model.model", config_dir, "--trainer.precision", "bf16-mixed",
            "--data.seq_len", "4096", "--trainer.gradient_clip_val", "1.0", "--gpu-memory", "24", "--host-memory", "24",
            "--json"]  # fmt: skip
    status, out = _run(capsys, [*args, "--trainer.strategy.init_args.placement", "stream"])
    streamed = json.loads(out)
    assert (status, streamed["schedule"]) == (0, "norm-first")  # the step's gradients would not fit the RAM
    status, out = _run(capsys, args)
    kept = json.loads(out)
    assert (status, kept["schedule"]) == (0, "forward")
    assert any(u["weights"] == "gpu" for u in kept["units"] if ".layers." in u["name"])
    assert kept["predicted_step_s"] < streamed["predicted_step_s"]


def test_a_step_the_cpu_sets_the_pace_of_updates_some_blocks_during_the_next_forward(capsys, config_dir):
    args = [*QUICKSTART, "--model.config", "null", "--model.model", config_dir, "--trainer.precision", "bf16-mixed",
            "--data.seq_len", "4096", "--gpu-memory", "24", "--host-memory", "64", "--json"]  # fmt: skip
    status, out = _run(capsys, [*args, "--rate-cpu-params-per-s", "1e9"])
    deferred = json.loads(out)
    assert (status, deferred["schedule"]) == (0, "backward")
    assert 0 < deferred["deferred_blocks"] < 16
    _, out = _run(capsys, [*args, "--rate-cpu-params-per-s", "1e9", "--trainer.strategy.init_args.engine",
                           '{"deferred_updates": 0}'])  # fmt: skip
    none = json.loads(out)
    assert none["deferred_blocks"] == 0
    assert deferred["predicted_step_s"] < 0.99 * none["predicted_step_s"]
    assert deferred["host_bytes"] > none["host_bytes"]  # their gradients wait on the host
    _, out = _run(capsys, [*args, "--rate-cpu-params-per-s", "1e12"])  # the GPU sets the pace: nothing to gain
    assert json.loads(out)["deferred_blocks"] == 0


def test_a_step_the_cpu_sets_the_pace_of_delays_every_streamed_block_and_none_where_the_gpu_does(capsys, config_dir):
    args = [*QUICKSTART, "--model.config", "null", "--model.model", config_dir, "--trainer.precision", "bf16-mixed",
            "--data.seq_len", "4096", "--gpu-memory", "24", "--host-memory", "64", "--json",
            "--trainer.strategy.init_args.delayed_update", "true"]  # fmt: skip
    status, out = _run(capsys, [*args, "--rate-cpu-params-per-s", "1e9"])
    delayed = json.loads(out)
    streamed = sum(".layers." in u["name"] and u["weights"] == "stream" for u in delayed["units"])
    assert (status, delayed["schedule"]) == (0, "backward")
    assert delayed["delayed_blocks"] == streamed > 0
    _, out = _run(capsys, [*args, "--rate-cpu-params-per-s", "1e9", "--trainer.strategy.init_args.engine",
                           '{"delayed_blocks": 0}'])  # fmt: skip
    none = json.loads(out)
    assert none["delayed_blocks"] == 0
    assert delayed["predicted_step_s"] < 0.99 * none["predicted_step_s"]
    assert delayed["host_bytes"] > none["host_bytes"]  # two copies of each delayed block's weights
    _, out = _run(capsys, [*args, "--rate-cpu-params-per-s", "1e12"])  # the GPU sets the pace: nothing to gain
    assert json.loads(out)["delayed_blocks"] == 0


def _printed_plans() -> list[str]:
    # every `slide plan` line of the README's and recipes/configs' code blocks
    lines = []
    for doc in ("README.md", "recipes/configs/README.md"):
        with open(doc) as f:
            lines += [line.split("#")[0].strip() for line in f if line.startswith("slide plan ")]
    return lines


@pytest.mark.parametrize("line", _printed_plans())
def test_the_documented_plans_run_as_printed(capsys, line):
    status, out = _run(capsys, shlex.split(line)[2:])
    assert status == 0, out
    assert "does not fit" not in out


def test_the_blocks_kept_on_the_gpu_keep_their_attention_outputs_where_room_is_left(capsys, config_dir):
    # the 1.2 B Llama in bf16 on the project's attention: each block's output (2 bytes) and statistic (fp32) per query
    # head and token, counted in the GPU's figure; none where the blocks' inputs fill the GPU, or turned off
    args = [*QUICKSTART, "--model.config", "null", "--model.model", config_dir, "--trainer.precision", "bf16-mixed",
            "--data.seq_len", "4096", "--gpu-memory", "24", "--host-memory", "64", "--json"]  # fmt: skip
    plans = {}
    for name, extra in [("kept", []), ("off", ["--trainer.strategy.init_args.engine", '{"keep_attention": false}'])]:
        status, out = _run(capsys, [*args, *extra])
        assert status == 0
        plans[name] = json.loads(out)
    per_block = 4096 * 32 * (64 * 2 + 4)  # head dim 2048 / 32
    kept = plans["kept"]["kept_attention_bytes"]
    assert kept % per_block == 0
    assert 0 < kept // per_block <= 16
    assert plans["off"]["kept_attention_bytes"] == 0
    assert plans["kept"]["gpu_bytes"] == plans["off"]["gpu_bytes"] + kept
    assert plans["kept"]["gpu_bytes"] <= 0.95 * (24 - 0.5) * 2**30
    _, out = _run(capsys, [*args, "--data.seq_len", "65536"])  # the inputs alone outgrow the GPU: offloaded
    assert json.loads(out)["kept_attention_bytes"] == 0


def test_planning_leaves_transformers_as_it_was(capsys, config_dir):
    # the plan switches the model as a GPU run does (the fused rotary embedding patches its modeling file); the
    # switches are undone after, or every later model of the process would run them
    from transformers.models.llama import modeling_llama

    before = modeling_llama.apply_rotary_pos_emb
    status, _ = _run(capsys, [*QUICKSTART, "--model.config", "null", "--model.model", config_dir, "--trainer.precision",
                              "bf16-mixed", "--gpu-memory", "24", "--host-memory", "64", "--json"])  # fmt: skip
    assert status == 0
    assert modeling_llama.apply_rotary_pos_emb is before
