"""AppConfig: speculative-decoding settings (decode engines only) and the failure settings
(timeouts, admission bound), validated up front with messages naming the field."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.services.engine import cpu_kernels
from tandem.services.engine.config import EngineConfig
from tandem.services.serving.config import AppConfig, ConfigError
from tandem.services.serving.up import ready_line


def test_spec_settings_reach_decode_engines_only():
    config = AppConfig.from_dict({"spec": "ngram", "spec_k": 3}, "test")
    decode = config.engine_config(decodes=True).speculative
    assert (decode.method, decode.k) == ("ngram", 3)
    assert config.engine_config(decodes=False).speculative.method == "none"


@pytest.mark.parametrize("settings, message", [
    ({"spec": "medusa"}, "spec must be one of none, ngram, draft, self"),
    ({"spec": "ngram", "spec_k": 0}, "spec_k must be between 1 and 16"),
    ({"spec": "draft"}, "spec: draft needs draft_model"),
    ({"spec": "draft", "draft_model": "/no/such/draft.gguf"}, "does not exist"),
    ({"spec_k": "4"}, "spec_k must be int"),
])
def test_bad_spec_settings_fail_with_a_clear_message(settings, message):
    with pytest.raises(ConfigError, match=message):
        AppConfig.from_dict(settings, "test")


@pytest.mark.parametrize(("settings", "message"), [
    ({"request_timeout_s": 0}, "request_timeout_s must be > 0"),
    ({"prefill_timeout_s": -1.0}, "prefill_timeout_s must be > 0"),
    ({"control_timeout_s": 0.0}, "control_timeout_s must be > 0"),
    ({"kv_transfer_timeout_s": 0}, "kv_transfer_timeout_s must be > 0"),
    ({"stream_idle_timeout_s": 0}, "stream_idle_timeout_s must be > 0"),
    ({"max_in_flight": 0}, "max_in_flight must be >= 1"),
])
def test_bad_failure_settings_fail_with_a_clear_message(settings, message):
    with pytest.raises(ConfigError, match=message):
        AppConfig(**settings)


def test_the_in_flight_bound_defaults_to_one_decode_batch():
    assert AppConfig(max_num_seqs=32, decode_replicas=3).in_flight_limit() == 96
    assert AppConfig(max_num_seqs=8, colocated=True, decode_replicas=3).in_flight_limit() == 8
    assert AppConfig(max_in_flight=5).in_flight_limit() == 5


GATEWAYS = {"gateway_replicas": 3, "gateway_resource": "tandem_gateway", "host": "0.0.0.0",
            "redis_url": "redis://127.0.0.1:6379/0"}


def test_several_gateways_share_the_bounds_and_what_one_keeps():
    """Each gateway replica admits its share of the cluster's bound (rounded up) and of the
    tenant limits; the flag reaches the setting."""
    config = AppConfig.from_dict({**GATEWAYS, "max_num_seqs": 32, "decode_replicas": 2},
                                 "test")
    assert config.in_flight_limit() == 64
    assert config.gateway_share(config.in_flight_limit()) == 22
    assert AppConfig().gateway_share(64) == 64
    settings = _up_settings("--gateways", "2", "--gateway-resource", "g", "--host", "0.0.0.0",
                            "--redis-url", "redis://r:6379/0", "--prefill", "1")
    assert AppConfig.from_dict(settings, "command line").gateway_replicas == 2


def test_each_gateway_enforces_its_share_of_the_tenant_limits():
    from tandem.services.serving.gateway import tenants_of

    config = AppConfig.from_dict({**GATEWAYS, "tenant_requests_per_minute": 100,
                                  "tenant_tokens_per_minute": 9000}, "test")
    tenants = tenants_of(config)
    assert (tenants.requests_per_minute, tenants.tokens_per_minute) == (34, 3000)
    alone = tenants_of(AppConfig(tenant_requests_per_minute=100))
    assert (alone.requests_per_minute, alone.tokens_per_minute) == (100, None)


@pytest.mark.parametrize(("change", "message"), [
    ({"gateway_replicas": 0}, "gateway_replicas must be >= 1"),
    ({"gateway_resource": None}, "gateway_replicas 3 needs gateway_resource"),
    ({"host": "127.0.0.1"}, "gateway_replicas 3 needs host 0.0.0.0"),
    ({"redis_url": None}, "gateway_replicas 3 needs redis_url"),
    ({"colocated": True}, "gateway_replicas 3: a colocated gateway is the engine"),
])
def test_several_gateways_need_a_node_each_and_a_shared_redis(change, message):
    with pytest.raises(ConfigError, match=message):
        AppConfig.from_dict({**GATEWAYS, **change}, "test")


def test_engine_threads_come_from_the_cpus_unless_set():
    cpus = len(os.sched_getaffinity(0))
    # One CPU left for the gateway and Ray; the rest shared by the engines on this machine.
    assert AppConfig().engine_threads() == max(1, (cpus - 1) // 2)
    assert AppConfig(colocated=True).engine_threads() == max(1, cpus - 1)
    assert AppConfig(prefill_replicas=4, decode_replicas=4).engine_threads() == max(
        1, (cpus - 1) // 8)
    assert AppConfig(threads_per_worker=3).engine_config().num_threads == 3
    assert AppConfig().engine_config().num_threads == AppConfig().engine_threads()
    with pytest.raises(ConfigError, match="threads_per_worker must be >= 1"):
        AppConfig(threads_per_worker=0)
    # `tandem up` says which shape it chose, and from what.
    line = ready_line(AppConfig(kernel_threads=1, dtype="float32"))
    assert line.endswith(f"(1 prefill, 1 decode; {max(1, (cpus - 1) // 2)} torch thread"
                         f"{'s' if (cpus - 1) // 2 > 1 else ''} per engine, from {cpus} CPUs; "
                         "dtype float32; no API keys)")
    assert ready_line(AppConfig(colocated=True, threads_per_worker=2, dtype="bfloat16")).endswith(
        "(colocated; 2 torch threads per engine; dtype bfloat16; no API keys)")
    keyed = AppConfig(api_keys_file="keys", cluster_secret_file="secret")
    assert ready_line(keyed).endswith("; API keys on)")


def test_kernel_threads_take_a_cpu_an_engine_of_one_thread_leaves(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def on(cpus: int, **settings: object) -> AppConfig:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
        return AppConfig(**settings)  # type: ignore[arg-type]

    # Two CPUs: one colocated engine of one torch thread, and a helper on the other CPU; a
    # prefill and a decode engine already have a CPU each.
    assert on(2, colocated=True).engine_kernel_threads() == 2
    assert on(2, colocated=True).engine_config().kernel_threads == 2
    # The helper is named where the engines run our kernels (bfloat16 or float32 on a CPU
    # that can), not for the torch backend.
    helper = " (+1 for our CPU kernels)" if cpu_kernels.unavailable_reason() is None else ""
    assert ready_line(on(2, colocated=True, dtype="bfloat16")).endswith(
        f"(colocated; 1 torch thread per engine{helper}, from 2 CPUs; dtype bfloat16; no API "
        "keys)")
    helper = " (+1 for our CPU kernels)" if cpu_kernels.f32_unavailable_reason() is None else ""
    assert f"per engine (2 in prefill steps){helper}, from" in ready_line(
        on(2, colocated=True, dtype="float32"))
    assert "CPU kernels" not in ready_line(on(2, colocated=True, dtype="float32",
                                              attention_backend="torch"))
    assert on(2).engine_kernel_threads() == 1
    assert on(4).engine_kernel_threads() == 2  # 1 torch thread each, 2 CPUs each
    assert on(8).engine_kernel_threads() == 1  # 3 torch threads each: oneDNN's projections
    assert on(2, colocated=True, threads_per_worker=2).engine_kernel_threads() == 1
    assert on(2, colocated=True, kernel_threads=1).engine_config().kernel_threads == 1
    assert on(8, kernel_threads=2).engine_kernel_threads() == 2
    with pytest.raises(ConfigError, match="kernel_threads must be 1 or 2, got 3"):
        AppConfig(kernel_threads=3)
    with pytest.raises(ValueError, match="kernel_threads must be 1 or 2, got 0"):
        EngineConfig(kernel_threads=0)


def test_prefill_steps_take_the_cpu_a_float32_engine_of_one_thread_leaves(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def on(cpus: int, **settings: object) -> AppConfig:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
        return AppConfig(**{"device": "cpu", **settings})  # type: ignore[arg-type]

    # Torch computes a float32 engine's projections: its prefill steps take the second CPU.
    assert on(2, colocated=True, dtype="float32").engine_prefill_threads() == 2
    assert on(2, colocated=True, dtype="float32").engine_config().prefill_threads == 2
    assert on(4, dtype="float32").engine_prefill_threads() == 2  # 1 torch thread, 2 CPUs each
    # Our bfloat16 kernels compute the projections (their helper takes that CPU); an engine of
    # several threads, or without a CPU to spare, keeps its threads.
    assert on(2, colocated=True, dtype="bfloat16").engine_prefill_threads() == 1
    assert on(2, dtype="float32").engine_prefill_threads() == 1
    assert on(8, dtype="float32").engine_prefill_threads() == 3
    assert on(2, colocated=True, dtype="float32", threads_per_worker=2
              ).engine_prefill_threads() == 2
    assert on(2, colocated=True, dtype="float32", prefill_threads=1
              ).engine_config().prefill_threads == 1
    assert "prefill steps" not in ready_line(on(2, colocated=True, dtype="float32",
                                                prefill_threads=1))
    with pytest.raises(ConfigError, match="prefill_threads must be >= 1, got 0"):
        AppConfig(prefill_threads=0)
    with pytest.raises(ValueError, match="prefill_threads must be >= 1, got 0"):
        EngineConfig(prefill_threads=0)


def test_keys_settings_and_tandem_ups_private_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import stat

    from tandem.services.serving.up import secret_files

    with pytest.raises(ConfigError, match="api_keys_file needs cluster_secret_file"):
        AppConfig(api_keys_file="keys")
    with pytest.raises(ConfigError, match="metrics_require_key needs api_keys_file"):
        AppConfig(metrics_require_key=True)
    with pytest.raises(ConfigError, match="tenant_requests_per_minute must be >= 1"):
        AppConfig(tenant_requests_per_minute=0)
    # Keys from the command line: a private file (0600) and a new secret, gone afterwards.
    with secret_files({"port": 1}, ["acme:sk-1", "bolt:sk-2"]) as settings:
        keys, secret = settings["api_keys_file"], settings["cluster_secret_file"]
        assert Path(keys).read_text().split() == ["acme:sk-1", "bolt:sk-2"]
        assert len(Path(secret).read_text().strip()) >= 32
        for path in (keys, secret):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(keys)).st_mode) == 0o700
        assert settings["port"] == 1
    assert not os.path.exists(keys) and not os.path.exists(secret)
    with secret_files({}, []) as settings:  # no keys: no keys file, still a cluster secret
        assert list(settings) == ["cluster_secret_file"]
        assert len(Path(settings["cluster_secret_file"]).read_text().strip()) >= 32
    with secret_files({"cluster_secret_file": "mine"}, []) as settings:
        assert settings == {"cluster_secret_file": "mine"}  # a named one is kept
    with pytest.raises(ConfigError, match="not both"), secret_files(
            {"api_keys_file": str(tmp_path / "k")}, ["a:b"]):
        pass
    with pytest.raises(ValueError, match="tenant:key"), secret_files({}, ["acme:"]):
        pass


def test_tensor_parallel_size_reaches_every_engine_and_their_threads():
    config = AppConfig.from_dict({"tensor_parallel_size": 2}, "test")
    assert config.engine_config(decodes=True).tensor_parallel_size == 2
    assert config.engine_config(decodes=False).tensor_parallel_size == 2  # prefill too
    cpus = len(os.sched_getaffinity(0))
    assert config.engine_threads() == max(1, (cpus - 1) // 4)  # 2 prefill + 2 decode ranks
    assert config.replace(colocated=True).engine_threads() == max(1, (cpus - 1) // 2)
    assert ready_line(config.replace(threads_per_worker=1, dtype="float32")).endswith(
        "(1 prefill, 1 decode (2 ranks each); 1 torch thread per engine rank; dtype float32; "
        "no API keys)")


@pytest.mark.parametrize("settings, message", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
    ({"tensor_parallel_size": "2"}, "tensor_parallel_size must be int"),
    ({"tensor_parallel_size": 2, "host_kv_cache_gb": 1},
     "tensor_parallel_size 2 does not support host_kv_cache_gb"),
    ({"tensor_parallel_size": 2, "spec": "self"},
     "tensor_parallel_size 2 does not support spec 'self'"),
])
def test_bad_tensor_parallel_settings_name_the_field(settings, message):
    with pytest.raises(ConfigError, match=message):
        AppConfig.from_dict(settings, "test")


def test_tensor_parallel_up_flag_reaches_the_config():
    import argparse

    from tandem.services.cli import _add_up_parser, up_settings

    parser = argparse.ArgumentParser(prog="tandem")
    _add_up_parser(parser.add_subparsers())
    settings = up_settings(parser.parse_args(["up", "--tensor-parallel-size", "2"]))
    assert AppConfig.from_dict(settings, "command line").tensor_parallel_size == 2
    default = AppConfig.from_dict(up_settings(parser.parse_args(["up"])), "-")
    assert default.tensor_parallel_size == 1


def _up_settings(*argv: str) -> dict:
    import argparse

    from tandem.services.cli import _add_up_parser, up_settings

    parser = argparse.ArgumentParser(prog="tandem")
    _add_up_parser(parser.add_subparsers())
    return up_settings(parser.parse_args(["up", *argv]))


def test_weight_format_up_flag_reaches_the_engine_config():
    args = ["--weight-format", "int4", "--dtype", "bfloat16", "--device", "cpu"]
    config = AppConfig.from_dict(_up_settings(*args), "command line")
    assert config.weight_format == "int4" and config.engine_config().weight_format == "int4"
    default = AppConfig.from_dict(_up_settings(), "-")
    assert default.weight_format == "dense" and default.engine_config().weight_format == "dense"
    with pytest.raises(ConfigError, match="weight_format int4 does not support dtype 'float32'"):
        AppConfig.from_dict(_up_settings("--weight-format", "int4", "--dtype", "float32"),
                            "command line")


def test_tandem_up_without_a_shape_colocates_on_a_small_cpu_machine():
    from tandem.services.serving.up import default_shape

    settings, why = default_shape(_up_settings("--dtype", "bfloat16"), cpus=2, gpu=False)
    config = AppConfig.from_dict(settings, "command line")
    assert config.colocated and config.dtype == "bfloat16"
    assert why is not None and "colocated" in why and "2 CPUs" in why
    # 4 CPUs: 1 thread each for a split pair; 5: 2 each, so the default split.
    assert default_shape({}, cpus=4, gpu=False)[0] == {"colocated": True}
    settings, why = default_shape({}, cpus=5, gpu=False)
    assert settings == {} and not AppConfig.from_dict(settings, "-").colocated
    assert why is not None and "1 prefill + 1 decode" in why
    # Tensor parallelism counts every rank: 2 ranks each need 2 x 2 threads + 1.
    assert default_shape({"tensor_parallel_size": 2}, cpus=8, gpu=False)[0]["colocated"]
    assert "colocated" not in default_shape({}, cpus=2, gpu=True)[0]  # GPUs: the split


@pytest.mark.parametrize("argv", [("--prefill", "1"), ("--decode", "2"), ("--colocated",)])
def test_a_shape_given_is_kept(argv):
    from tandem.services.serving.up import default_shape

    settings = _up_settings(*argv)
    assert default_shape(settings, cpus=2, gpu=False) == (settings, None)


def test_a_shape_in_the_config_file_is_kept(tmp_path: Path):
    from tandem.services.serving.up import default_shape

    config = tmp_path / "app.yaml"
    config.write_text("colocated: false\n")
    settings = _up_settings("--config", str(config))
    assert default_shape(settings, cpus=2, gpu=False) == (settings, None)


def test_serve_takes_a_vllm_serve_command_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # `tandem serve MODEL` with vLLM's names for the settings Tandem has; the same settings as
    # `tandem up --model MODEL` with them.
    import argparse

    from tandem.services.cli import _add_up_parser, up_settings

    parser = argparse.ArgumentParser()
    _add_up_parser(parser.add_subparsers())
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    flags = ["--served-model-name", "smol", "smol-latest", "--max-num-seqs", "8",
             "--max-model-len", "2048", "-tp", "1", "--max-num-batched-tokens", "256",
             "--kv-cache-dtype", "int8", "--dtype", "bfloat16", "--port", "8100",
             "--no-enable-prefix-caching", "--seed", "7", "--chat-template", str(template),
             "--generation-config", "vllm", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes"]
    served = up_settings(parser.parse_args(["serve", str(model), *flags]))
    assert served == up_settings(parser.parse_args(["up", "--model", str(model), *flags]))
    assert served == {"model": str(model), "served_model_name": ["smol", "smol-latest"],
                      "max_num_seqs": 8, "max_model_len": 2048, "tensor_parallel_size": 1,
                      "max_num_batched_tokens": 256, "kv_cache_dtype": "int8",
                      "dtype": "bfloat16", "port": 8100, "enable_prefix_caching": False,
                      "seed": 7, "chat_template": str(template), "generation_config": "vllm",
                      "tool_call_parser": "hermes"}
    config = AppConfig.from_dict(served, "command line")
    assert (config.served_model_names(), config.max_num_seqs, config.max_model_len) == (
        ("smol", "smol-latest"), 8, 2048)
    assert config.engine_config().enable_prefix_caching is False


def test_served_model_name_one_or_several() -> None:
    assert AppConfig(served_model_name="a").served_model_names() == ("a",)
    assert AppConfig(served_model_name=["a", "b"]).served_model_names() == ("a", "b")
    assert AppConfig().served_model_names() == ()
    with pytest.raises(ConfigError, match="served_model_name"):
        AppConfig.from_dict({"served_model_name": 3})
    with pytest.raises(ConfigError, match="served_model_name"):
        AppConfig(served_model_name=["a", ""])


def test_chat_template_and_generation_config_are_checked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert AppConfig(chat_template="{{ messages[0]['content'] }}").chat_template
    with pytest.raises(ValueError, match="chat_template: .* neither a file nor a Jinja template"):
        AppConfig(chat_template=str(tmp_path / "missing.jinja"))
    folder = tmp_path / "gen"
    folder.mkdir()
    with pytest.raises(ConfigError, match="generation_config must be auto, vllm or a folder"):
        AppConfig(generation_config=str(folder))
    (folder / "generation_config.json").write_text('{"temperature": 0.3}')
    assert AppConfig(generation_config=str(folder)).generation_config == str(folder)


def test_a_hub_id_is_a_model_and_a_missing_path_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert AppConfig(model="Qwen/Qwen3-0.6B@main").model == "Qwen/Qwen3-0.6B@main"
    with pytest.raises(ConfigError, match="does not exist"):
        AppConfig(model=str(tmp_path / "missing.gguf"))


def test_a_vllm_flag_tandem_lacks_is_refused_naming_it(capsys) -> None:  # type: ignore[no-untyped-def]
    from tandem.services.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/some/model", "--swap-space", "4"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --swap-space 4" in capsys.readouterr().err


def test_dtype_auto_is_the_fast_path_where_it_runs_and_says_why() -> None:
    # The default: bfloat16 where our CPU kernels run (a CPU with AVX-512 BF16), else
    # float32; an explicit dtype is taken as it is, float32 (exact against transformers) too.
    reason = cpu_kernels.unavailable_reason()
    default = AppConfig()
    assert default.dtype == "auto"
    dtype, why = default.engine_dtype()
    assert default.engine_config().dtype == dtype
    if reason is None:
        assert (dtype, why) == ("bfloat16", "auto: our bfloat16 CPU kernels run here")
    else:
        assert dtype == "float32" and reason in why
    assert f"; dtype {dtype} ({why}); " in ready_line(default)
    assert AppConfig(dtype="float32").engine_config().dtype == "float32"
    assert AppConfig(dtype="float32").engine_dtype() == ("float32", "")
    assert AppConfig(device="cpu", weight_format="int4").weight_format == "int4"  # auto allows
    with pytest.raises(ConfigError, match="dtype must be one of auto, float32, bfloat16"):
        AppConfig(dtype="float16")
