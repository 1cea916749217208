"""meshcoll._settings.core_config_from_env: the C++ core's settings (Note [Configuration] in
csrc/common/config.h), each variable parsed, and each bad value named. Pure logic: every call
gets an explicit `environ=` dict."""

import pytest

from meshcoll._settings import CoreConfig, core_config_from_env


def test_unset_environment_is_the_defaults():
    assert core_config_from_env({}) == CoreConfig()


@pytest.mark.parametrize("env, field, value", [
    ({"MESHCOLL_HOST_ID": "rack7"}, "host_id", "rack7"),
    ({"MESHCOLL_HOST_ID": ""}, "host_id", ""),  # empty counts as unset
    ({"MESHCOLL_CMA": "0"}, "cma", False),
    ({"MESHCOLL_CMA": "1"}, "cma", True),
    ({"MESHCOLL_SHM_ALL_REDUCE": "flat"}, "shm_all_reduce", "flat"),
    ({"MESHCOLL_SHM_ALL_REDUCE": "scalable"}, "shm_all_reduce", "scalable"),
    ({"MESHCOLL_SHM_SINGLE_COPY_BYTES": "16384"}, "shm_single_copy_bytes", 16384),
    ({"MESHCOLL_SHM_SINGLE_COPY_BYTES": "0"}, "shm_single_copy_bytes", 0),
    ({"MESHCOLL_SHM_SPIN_US": "0"}, "shm_spin_us", 0),
    ({"MESHCOLL_SHM_SPIN_US": "5000"}, "shm_spin_us", 5000),
    ({"MESHCOLL_SIMD": "avx2"}, "simd", "avx2"),
    ({"MESHCOLL_SIMD": "baseline"}, "simd", "baseline"),
    ({"MESHCOLL_NCCL_TRACE": "1"}, "nccl_trace", True),
    ({"MESHCOLL_NCCL_LIBRARY": "/opt/nccl/libnccl.so.2"}, "nccl_library",
     "/opt/nccl/libnccl.so.2"),
    ({"MESHCOLL_NCCL_SPLIT": "0"}, "nccl_split", False),
    ({"MESHCOLL_NCCL_DIRECT_BYTES": "0"}, "nccl_direct_bytes", 0),
    ({"MESHCOLL_NCCL_DIRECT_BYTES": "1048576"}, "nccl_direct_bytes", 1 << 20),
    ({"MESHCOLL_FAULT": "kill@shm/created"}, "fault", "kill@shm/created"),
    ({"MESHCOLL_FAULT": "stop@settings"}, "fault", "stop@settings"),
])
def test_each_variable(env, field, value):
    assert getattr(core_config_from_env(env), field) == value


@pytest.mark.parametrize("name, text", [
    ("MESHCOLL_SIMD", "sse9"), ("MESHCOLL_SIMD", "AVX2"), ("MESHCOLL_CMA", "yes"),
    ("MESHCOLL_NCCL_TRACE", "on"), ("MESHCOLL_NCCL_SPLIT", "2"), ("MESHCOLL_FAULT", "die"),
    ("MESHCOLL_NCCL_DIRECT_BYTES", "-1"), ("MESHCOLL_NCCL_DIRECT_BYTES", "lots"),
    ("MESHCOLL_NCCL_DIRECT_BYTES", "134217728"), ("MESHCOLL_SHM_SPIN_US", "-2"),
    ("MESHCOLL_SHM_SPIN_US", "soon"), ("MESHCOLL_FAULT", "kill@nowhere"),
    ("MESHCOLL_FAULT", "stop@"), ("MESHCOLL_FAULT", "kill@shm"),
    ("MESHCOLL_FAULT", "hang@settings"), ("MESHCOLL_SHM_ALL_REDUCE", "fast"),
    ("MESHCOLL_SHM_SINGLE_COPY_BYTES", "-1"), ("MESHCOLL_SHM_SINGLE_COPY_BYTES", "4M"),
])
def test_bad_value_names_the_variable(name, text):
    with pytest.raises(ValueError, match=f"{name}='{text}'"):
        core_config_from_env({name: text})


def test_an_unknown_fault_point_names_the_points():
    # A point no setup step reaches would never fire: a fault test would inject nothing.
    with pytest.raises(ValueError, match="settings, shm/host, shm/created, shm/mapped, shm/cma"):
        core_config_from_env({"MESHCOLL_FAULT": "kill@nowhere"})
