"""Mixed precision by capability (book/intro.md's choose_precision, book/trainer.md's loop).

The choice is checked on a CPU by pretending to have a CUDA GPU of each compute capability; the fp16 training
path (autocast, GradScaler, unscale before clipping, the scaler's state in checkpoints) runs on the CPU with a
``Precision`` made by hand. The command line's options and the records are checked too. Tests marked ``cuda``
run the real thing where a GPU is present.
"""
from __future__ import annotations

import contextlib
import io
import json
import warnings

import pytest
import torch

from annotated_transformer import runtime, trainer
from annotated_transformer.checkpoints import load_checkpoint
from annotated_transformer.folders import latest_checkpoint, list_checkpoints
from annotated_transformer.cli import build_parser, main
from annotated_transformer.model import make_model
from annotated_transformer.runtime import (AMP_TYPES, Precision, choose_precision, cpu_has_bf16_kernels,
                                           describe_device)
from annotated_transformer.copy_task import copy_batches, train_copy_task
from annotated_transformer.trainer import train
from annotated_transformer.training import LabelSmoothing, make_optimizer, make_scheduler

FP16 = Precision("cpu", torch.float16, "made by hand for the test")


@pytest.fixture
def gpu_of_capability(monkeypatch):
    """Pretend that this machine has one CUDA GPU of the given compute capability (no CUDA work is done)."""
    def pretend(major: int, minor: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
    monkeypatch.delenv("AT_DEVICE", raising=False)
    return pretend


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Pretend that this CPU has (True), lacks (False) or cannot tell (None) fast bfloat16 kernels."""
    def pretend(has: bool | None) -> None:
        monkeypatch.setattr(runtime, "cpu_has_bf16_kernels", lambda: has)
    pretend(True)  # the tests below that ask for bf16 on a CPU are not about its kernels
    return pretend


# The choice --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("capability, name", [((6, 1), "fp16"), ((7, 0), "fp16"), ((7, 5), "fp16"),
                                              ((8, 0), "bf16"), ((8, 6), "bf16"), ((8, 9), "bf16"),
                                              ((9, 0), "bf16"), ((10, 0), "bf16")])
def test_a_gpu_gets_bf16_from_capability_8_and_fp16_with_scaling_below(gpu_of_capability, capability, name):
    gpu_of_capability(*capability)
    for device in (None, "cuda", "cuda:0", torch.device("cuda")):
        precision = choose_precision(device)
        assert precision.device == "cuda" and precision.name == name
        assert precision.scaled == (name == "fp16")
        assert f"compute capability {capability[0]}.{capability[1]}" in str(precision)
        assert choose_precision(device, amp=True) == precision  # --amp alone: the same choice


def test_a_cpu_gets_fp32_by_default_and_bf16_only_when_asked(monkeypatch, cpu_bf16):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert choose_precision().name == choose_precision("cpu").name == "fp32"
    assert choose_precision("cpu", amp=False).name == choose_precision("cpu", "fp32").name == "fp32"
    for amp in (True, "bf16", "BF16", " bfloat16 ", torch.bfloat16):
        precision = choose_precision("cpu", amp)
        assert precision.name == "bf16" and not precision.scaled, amp


def test_bf16_on_a_cpu_without_fast_kernels_warns_and_the_precision_says_so(cpu_bf16):
    cpu_bf16(False)
    with pytest.warns(UserWarning, match="bf16 was asked for, but this CPU has no fast bfloat16 kernels") as caught:
        precision = choose_precision("cpu", "bf16")
    assert len(caught) == 1 and precision.name == "bf16" and not precision.scaled
    assert str(precision) == "bf16 autocast on cpu (asked for; no native bfloat16 here)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_precision("cpu").name == "fp32"  # the default never warns
        for has in (True, None):  # fast kernels, or a PyTorch that cannot tell: no warning
            cpu_bf16(has)
            assert str(choose_precision("cpu", True)) == "bf16 autocast on cpu (asked for)"


def test_the_kernel_check_and_the_device_name_follow_this_machine():
    has = cpu_has_bf16_kernels()
    assert has in (True, False, None)
    name = describe_device("cpu")
    assert name.startswith("cpu (") and f"thread{'' if torch.get_num_threads() == 1 else 's'}, " in name
    native = has and runtime.cpu_has_bf16_instructions() is not False  # kernels and instructions
    assert name.endswith(f", {torch.backends.cpu.get_cpu_capability()}{', bf16' if native else ''})"), name


@pytest.mark.parametrize("amp", ["fp16", "float16", torch.float16])
def test_fp16_on_a_cpu_is_refused_in_one_line(amp):
    with pytest.raises(ValueError, match="fp16 on a CPU is refused") as error:
        choose_precision("cpu", amp)
    assert "\n" not in str(error.value) and "--amp-dtype bf16" in str(error.value)


def test_mps_trains_in_fp32_and_refuses_autocast(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert choose_precision("mps").name == "fp32"
    assert choose_precision("mps", amp=False).name == "fp32"
    for amp in (True, "bf16", "fp16"):
        with pytest.raises(ValueError, match="autocast on mps is not supported"):
            choose_precision("mps", amp)


def test_the_type_asked_for_wins_on_a_gpu(gpu_of_capability):
    gpu_of_capability(9, 0)
    assert choose_precision("cuda", "fp16").name == "fp16"
    assert choose_precision("cuda", amp=False).name == "fp32"
    gpu_of_capability(7, 5)
    with pytest.warns(UserWarning, match="compute capability 7.5 has no native bfloat16"):
        assert choose_precision("cuda", "bf16").name == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where bfloat16 is native
        gpu_of_capability(8, 0)
        assert choose_precision("cuda", "bf16").name == "bf16"


@pytest.mark.parametrize("bad", ["fp8", "", "half", 16, 1.0, torch.int8, torch.float64, [True]])
def test_a_bad_amp_is_refused_naming_the_values(bad):
    with pytest.raises(ValueError, match="amp must be None, True, False, 'bf16', 'fp16' or 'fp32'"):
        choose_precision("cpu", bad)


def test_a_precision_made_for_the_device_is_kept_and_another_is_checked(gpu_of_capability):
    assert choose_precision("cpu", FP16) is FP16  # made by hand: taken as it is
    with pytest.raises(ValueError, match="fp16 on a CPU"):  # made for another device: its type is checked
        choose_precision("cpu", Precision("cuda", torch.float16))
    gpu_of_capability(7, 5)
    assert choose_precision("cuda", Precision("cpu", torch.float16)).device == "cuda"


def test_precision_objects():
    fp32, bf16 = Precision("cpu"), Precision("cuda", torch.bfloat16, "compute capability 9.0: native bfloat16")
    assert (fp32.name, bf16.name, FP16.name) == ("fp32", "bf16", "fp16")
    assert [p.scaled for p in (fp32, bf16, FP16)] == [False, False, True]
    assert str(bf16) == "bf16 autocast on cuda (compute capability 9.0: native bfloat16)"
    assert str(FP16).startswith("fp16 autocast with loss scaling on cpu")
    assert not fp32.grad_scaler().is_enabled() and FP16.grad_scaler().is_enabled()
    assert fp32.grad_scaler().state_dict() == {}
    assert isinstance(fp32.autocast(), contextlib.nullcontext)
    with FP16.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.float16 and torch.is_autocast_enabled("cpu")
    assert set(AMP_TYPES) == {"bf16", "fp16"}
    for device, dtype in ((torch.device("cpu"), torch.float32), ("cpu", torch.float64)):
        with pytest.raises(ValueError, match="a Precision is a device type"):
            Precision(device, dtype)


# The fp16 training path, on a CPU --------------------------------------------------------------------------------

def tiny_batch(index):
    return next(copy_batches(11, 8, 6, 1, generator=torch.Generator().manual_seed(index)))


def tiny_run(folder=None, *, amp=None, resume=False, crash_at=None, init_seed=0, steps=6, clip_norm=None):
    torch.manual_seed(init_seed)
    model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2, dropout=0.1)
    optimizer = make_optimizer(model)

    def batches(index):
        if index == crash_at:
            raise KeyboardInterrupt("crash")
        return tiny_batch(index)

    history = train(model, batches, steps=steps, optimizer=optimizer, scheduler=make_scheduler(optimizer, 16, warmup=3),
                    loss_fn=LabelSmoothing(11, 0, 0.1), accumulation_steps=2, checkpoint_dir=folder,
                    checkpoint_every=2, resume=resume, progress=False, amp=amp, clip_norm=clip_norm)
    return model, history


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_fp16_training_scales_skips_an_overflow_and_resumes_exactly(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    loaded = []
    load_state_dict = torch.amp.GradScaler.load_state_dict
    monkeypatch.setattr(torch.amp.GradScaler, "load_state_dict",
                        lambda self, state: (loaded.append(state), load_state_dict(self, state)))
    straight, history = tiny_run(tmp_path / "straight", amp=FP16)
    final = load_checkpoint(latest_checkpoint(tmp_path / "straight"))["extra"]
    initial = torch.amp.GradScaler("cpu").get_scale()
    assert final["precision"] == "fp16" and final["grad_scaler"]["scale"] < initial  # an overflow was skipped
    assert all(p.dtype == torch.float32 for p in straight.parameters()) and len(history["loss"]) == 6
    with pytest.raises(KeyboardInterrupt):
        tiny_run(tmp_path / "resumed", amp=FP16, crash_at=10)
    saved = load_checkpoint(latest_checkpoint(tmp_path / "resumed"))["extra"]["grad_scaler"]
    assert saved["scale"] < initial  # the overflow came before the crash
    torch.manual_seed(12345)
    resumed, _ = tiny_run(tmp_path / "resumed", amp=FP16, resume=True, init_seed=1)
    assert loaded == [saved]  # the resumed run went on with the scale the checkpoint held
    assert same_weights(straight, resumed)


def test_fp16_forward_runs_in_float16_and_the_loss_is_scaled(monkeypatch):
    dtypes, scaled = set(), []
    original_scale = torch.amp.GradScaler.scale

    def scale(self, outputs):
        result = original_scale(self, outputs)
        scaled.append(result.item() / outputs.item())
        return result

    monkeypatch.setattr(torch.amp.GradScaler, "scale", scale)
    torch.manual_seed(0)
    model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    model.generator.proj.register_forward_hook(lambda module, inputs, output: dtypes.add(output.dtype))
    train(model, tiny_batch, steps=2, optimizer=make_optimizer(model), loss_fn=LabelSmoothing(11, 0, 0.0),
          amp=FP16, progress=False)
    assert dtypes == {torch.float16} and scaled[0] == torch.amp.GradScaler("cpu").get_scale()
    dtypes.clear()
    scaled.clear()
    train(model, tiny_batch, steps=1, optimizer=make_optimizer(model), loss_fn=LabelSmoothing(11, 0, 0.0),
          progress=False)  # the CPU's default: fp32, and the disabled scaler leaves the loss as it is
    assert dtypes == {torch.float32} and scaled == [1.0]


def test_the_scaler_unscales_before_clipping_and_steps_then_updates(monkeypatch):
    calls, norms = [], []
    for name in ("unscale_", "step", "update"):
        original = getattr(torch.amp.GradScaler, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.amp.GradScaler, name, spy)
    clip = torch.nn.utils.clip_grad_norm_

    def clip_spy(parameters, max_norm, *args, **kwargs):
        calls.append("clip")
        norms.append(float(clip(parameters, max_norm, *args, **kwargs)))
        return torch.tensor(norms[-1])
    monkeypatch.setattr(trainer.nn.utils, "clip_grad_norm_", clip_spy)
    _, history = tiny_run(amp=FP16, clip_norm=1.0)
    assert calls == ["unscale_", "clip", "step", "update"] * 6
    finite = [norm for norm in norms if norm == norm and norm != float("inf")]
    assert finite and max(finite) < 100  # true gradient norms, not 65536 times too large
    assert len(history["loss"]) == 6  # an overflowed norm (inf) did not stop the run


def test_a_nan_loss_still_stops_an_fp16_run(tmp_path):
    smoothing, calls = LabelSmoothing(11, 0, 0.1), []

    def loss_fn(log_probs, labels):
        calls.append(1)
        loss = smoothing(log_probs, labels)
        return loss * float("nan") if len(calls) == 3 else loss

    torch.manual_seed(0)
    model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    with pytest.raises(trainer.NonFiniteLossError, match="step 3"):
        train(model, tiny_batch, steps=5, optimizer=make_optimizer(model), loss_fn=loss_fn, amp=FP16,
              checkpoint_dir=tmp_path, checkpoint_every=1, progress=False)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt", "step_00000002.pt"]


def test_checkpoints_name_the_precision_and_resuming_in_another_warns(tmp_path, cpu_bf16):
    tiny_run(tmp_path, steps=2)
    extra = load_checkpoint(latest_checkpoint(tmp_path))["extra"]
    assert extra["precision"] == "fp32" and extra["grad_scaler"] == {}
    with pytest.warns(UserWarning, match="trained in fp32, this run goes on in bf16"):
        tiny_run(tmp_path, steps=4, resume=True, amp="bf16")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="the checkpoint was trained in")
        tiny_run(tmp_path, steps=6, resume=True, amp="bf16")  # the same precision: no warning


def test_a_run_prints_its_precision_with_its_progress_bar(capsys):
    train_copy_task(steps=1, d_model=16, d_ff=32, h=2, batch_size=4, device="cpu", profile="quick")
    assert "precision: fp32 on cpu (the default on cpu)" in capsys.readouterr().out
    train_copy_task(steps=1, d_model=16, d_ff=32, h=2, batch_size=4, device="cpu", profile="quick",
                    progress=False)
    assert "precision" not in capsys.readouterr().out


def test_the_copy_task_refuses_fp16_on_a_cpu_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="fp16 on a CPU"):
        train_copy_task(steps=1, device="cpu", amp="fp16", checkpoint_dir=tmp_path / "run", profile="quick")
    assert not (tmp_path / "run").exists()


# The command line -----------------------------------------------------------------------------------------------

COPY = ["train", "--task", "copy", "--profile", "quick", "--steps", "2", "--d-model", "16", "--layers", "1",
        "--batch-size", "4", "--device", "cpu"]


def run_main(argv):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv)
    return code, stdout.getvalue(), stderr.getvalue()


def test_the_command_line_records_the_precision_it_was_given(tmp_path, cpu_bf16):
    code, out, _ = run_main(COPY + ["--amp-dtype", "bf16", "--checkpoint-dir", str(tmp_path / "bf16")])
    assert code == 0 and "precision: bf16 autocast on cpu (asked for)" in out
    assert load_checkpoint(latest_checkpoint(tmp_path / "bf16"))["extra"]["precision"] == "bf16"
    code, out, _ = run_main(COPY + ["--checkpoint-dir", str(tmp_path / "default"), "--no-progress"])
    assert code == 0 and load_checkpoint(latest_checkpoint(tmp_path / "default"))["extra"]["precision"] == "fp32"
    code, _, _ = run_main(COPY + ["--amp", "--checkpoint-dir", str(tmp_path / "amp"), "--no-progress"])
    assert code == 0 and load_checkpoint(latest_checkpoint(tmp_path / "amp"))["extra"]["precision"] == "bf16"


def test_the_command_line_warns_in_one_line_of_bf16_on_a_cpu_without_it(tmp_path, cpu_bf16):
    cpu_bf16(False)
    code, out, err = run_main(COPY + ["--amp", "--checkpoint-dir", str(tmp_path / "run"), "--no-progress"])
    assert code == 0 and load_checkpoint(latest_checkpoint(tmp_path / "run"))["extra"]["precision"] == "bf16"
    warned = [line for line in err.splitlines() if "bfloat16 kernels" in line]
    assert warned == ["warning: bf16 was asked for, but this CPU has no fast bfloat16 kernels: slow generic code, "
                      "often slower than fp32 (the default here)"], err


@pytest.mark.parametrize("argv, message", [
    (COPY + ["--amp-dtype", "fp16"], "error: fp16 on a CPU is refused"),
    (COPY + ["--no-amp", "--amp-dtype", "bf16"], "error: --no-amp and --amp-dtype bf16 contradict each other"),
    (["train", "--task", "multi30k", "--device", "cpu", "--no-amp", "--amp-dtype", "fp16"],
     "error: --no-amp and --amp-dtype fp16 contradict each other"),
])
def test_the_command_line_refuses_a_bad_precision_in_one_line(tmp_path, argv, message):
    code, out, err = run_main(argv + ["--checkpoint-dir", str(tmp_path / "run")])
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_the_amp_type_is_a_choice():
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exit_:
        main(COPY + ["--amp-dtype", "fp8"])
    assert exit_.value.code == 2 and "argument --amp-dtype: invalid choice: 'fp8'" in stderr.getvalue()
    args = build_parser(only="train").parse_args(["train", "--amp-dtype", "fp16"])
    assert (args.amp, args.amp_dtype) == (None, "fp16")
    help_text = build_parser(only="train")._subparsers._group_actions[0].choices["train"].format_help()
    assert "--amp-dtype {bf16,fp16}" in help_text and "compute capability 8.0" in help_text


# The records ----------------------------------------------------------------------------------------------------

from local_data import FOLDER as DATA, needs_data  # noqa: E402 (the records' section)


@needs_data
def test_a_translation_record_and_its_checkpoints_name_the_precision(tmp_path, monkeypatch):
    from annotated_transformer.records import record_experiment
    from annotated_transformer.translation import translation_config

    monkeypatch.setenv("ANNOTATED_TRANSFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ANNOTATED_TRANSFORMER_DATA", str(DATA))
    torch.set_num_threads(1)
    config = translation_config("quick", vocab_size=300, train_limit=1000, max_len=16, N=1, d_model=16, d_ff=32,
                                h=2, max_tokens=300, steps=4, warmup=2, checkpoint_every=2, average=2,
                                eval_every=4, valid_limit=10, test_limit=4, beam_size=2)
    lines = []
    record, trained = record_experiment(config, tmp_path / "run", results_path=tmp_path / "r.json", device="cpu",
                                        progress=False, log=lines.append)
    assert "precision: fp32 on cpu (the default on cpu)" in lines
    assert record["precision"] == trained["precision"] == "fp32"
    assert json.loads((tmp_path / "r.json").read_text())["precision"] == "fp32"
    assert record["compiled"] is trained["compiled"] is False  # no --compile
    # the target tokens the validation losses are means over: each sentence's pieces, then </s>
    from annotated_transformer.data import load_split
    valid = load_split("valid")[: config.valid_limit]
    expected = sum(len(trained["tokenizer"].encode(target)) for _, target in valid)  # </s> included
    assert record["valid_tokens"] == expected > len(valid)
    for name in ("average.pt", "step_00000004.pt"):
        assert load_checkpoint(tmp_path / "run" / name)["extra"]["precision"] == "fp32"



@needs_data
def test_a_compiled_translation_run_says_so(tmp_path, monkeypatch):
    """compile=True reaches train's torch.compile (here a stand-in that counts and returns what it is given, so
    that the test costs no compiling), and what train_translator returns, the record's source, says so."""
    from annotated_transformer.translation import train_translator, translation_config

    monkeypatch.setenv("ANNOTATED_TRANSFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ANNOTATED_TRANSFORMER_DATA", str(DATA))
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compiled.append(fn) or fn)
    torch.set_num_threads(1)
    config = translation_config("quick", vocab_size=300, train_limit=1000, max_len=16, N=1, d_model=16, d_ff=32,
                                h=2, max_tokens=300, steps=2, warmup=2, checkpoint_every=2, average=1,
                                eval_every=2, valid_limit=10)
    trained = train_translator(config, tmp_path / "run", device="cpu", compile=True, progress=False,
                               log=lambda line: None)
    assert trained["compiled"] is True and len(compiled) == 2  # the model and the loss

# On a GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_cuda_choice_follows_this_gpu():
    native = torch.cuda.get_device_capability()[0] >= 8
    precision = choose_precision("cuda")
    assert precision.name == ("bf16" if native else "fp16") and precision.scaled == (not native)


@pytest.mark.cuda
@pytest.mark.parametrize("amp", ["fp16", None])
def test_cuda_copy_task_trains_in_its_precision(tmp_path, amp):
    model, history = train_copy_task(steps=400, device="cuda", amp=amp, checkpoint_dir=tmp_path, profile="quick",
                                     progress=False)
    extra = load_checkpoint(latest_checkpoint(tmp_path))["extra"]
    assert extra["precision"] == choose_precision("cuda", amp).name
    assert (extra["grad_scaler"] != {}) == (extra["precision"] == "fp16")
    assert history["loss"][-1] < history["loss"][0] / 4
