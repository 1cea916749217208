"""meshcoll._rendezvous and meshcoll._settings: every launcher scheme, precedence, and each error names its variable.

Pure logic: every call gets an explicit `environ=` dict, never os.environ.
"""

import pytest

from meshcoll._rendezvous import (
    InitMethod,
    Rendezvous,
    init_method_from_env,
    launcher_env,
    parse_init_method,
    rendezvous_from_env,
)
from meshcoll._settings import (
    GroupOptions,
    shm_bytes_from_env,
    socket_ifname_from_env,
    timeout_from_env,
)

MASTER = {"MESHCOLL_MASTER_ADDR": "10.0.0.1", "MESHCOLL_MASTER_PORT": "29500"}


def rdv(environ, **kw):
    return rendezvous_from_env(environ=environ, **kw)


# -- each scheme --------------------------------------------------------------

def test_meshcoll_scheme_reads_everything():
    env = {"MESHCOLL_RANK": "3", "MESHCOLL_WORLD_SIZE": "8", "MESHCOLL_LOCAL_RANK": "1",
           "MESHCOLL_LOCAL_WORLD_SIZE": "2", "MESHCOLL_TOKEN": "abc", **MASTER}
    assert rdv(env) == Rendezvous(rank=3, world_size=8, local_rank=1, local_world_size=2,
                                  master_addr="10.0.0.1", master_port=29500, token="abc",
                                  source="meshcoll")


def test_torchrun_scheme_uses_torch_master():
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "host0", "MASTER_PORT": "1234"}
    assert rdv(env) == Rendezvous(1, 4, 1, 4, "host0", 1234, None, "torchrun")


def test_slurm_scheme_with_tasks_per_node():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "2(x3),1", **MASTER}
    r = rdv(env)
    assert (r.rank, r.world_size, r.local_rank, r.local_world_size, r.source) == \
        (5, 7, 1, 2, "slurm")
    env["SLURM_NODEID"] = "3"
    env["SLURM_LOCALID"] = "0"
    assert rdv(env).local_world_size == 1


def test_slurm_step_tasks_per_node_wins_over_allocation():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "4",
           "SLURM_STEP_TASKS_PER_NODE": "2", **MASTER}
    assert rdv(env).local_world_size == 2


def test_slurm_unknown_tasks_format_gives_none_not_a_guess():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "weird", **MASTER}
    assert rdv(env).local_world_size is None


def test_openmpi_scheme():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1", **MASTER}
    assert rdv(env) == Rendezvous(2, 3, 0, 1, "10.0.0.1", 29500, None, "openmpi")


def test_pmi_scheme():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
           "MPI_LOCALNRANKS": "2", **MASTER}
    assert rdv(env) == Rendezvous(1, 2, 1, 2, "10.0.0.1", 29500, None, "pmi")


def test_missing_local_variables_give_none():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", **MASTER}
    r = rdv(env)
    assert (r.local_rank, r.local_world_size) == (None, None)


def test_arguments_scheme():
    r = rdv({}, rank=1, world_size=2, master_addr="h", master_port=5)
    assert r == Rendezvous(1, 2, None, None, "h", 5, None, "arguments")


def test_single_process_needs_no_master():
    assert rdv({}, rank=0, world_size=1) == \
        Rendezvous(0, 1, 0, 1, "127.0.0.1", 0, None, "arguments")


def test_single_process_from_env_needs_no_master_either():
    r = rdv({"MESHCOLL_RANK": "0", "MESHCOLL_WORLD_SIZE": "1"})
    assert (r.master_addr, r.master_port, r.source) == ("127.0.0.1", 0, "meshcoll")


def test_single_process_keeps_a_given_master():
    r = rdv({}, rank=0, world_size=1, master_addr="10.1.1.1", master_port=7)
    assert (r.master_addr, r.master_port) == ("10.1.1.1", 7)


# -- precedence ---------------------------------------------------------------

ALL_SCHEMES = {
    "MESHCOLL_RANK": "0", "MESHCOLL_WORLD_SIZE": "10",
    "RANK": "1", "WORLD_SIZE": "20",
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "30",
    "PMI_RANK": "3", "PMI_SIZE": "40",
    "SLURM_PROCID": "4", "SLURM_NTASKS": "50",
    **MASTER,
}
ORDER = [("MESHCOLL_RANK", "MESHCOLL_WORLD_SIZE", "meshcoll"),
         ("RANK", "WORLD_SIZE", "torchrun"),
         ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "openmpi"),
         ("PMI_RANK", "PMI_SIZE", "pmi"),
         ("SLURM_PROCID", "SLURM_NTASKS", "slurm")]


@pytest.mark.parametrize("first", range(len(ORDER)))
def test_scheme_precedence(first):
    env = dict(ALL_SCHEMES)
    for rank_var, size_var, _ in ORDER[:first]:
        del env[rank_var], env[size_var]
    r = rdv(env)
    assert (r.rank, r.world_size, r.source) == (first, 10 * (first + 1), ORDER[first][2])


def test_mpi_wins_over_slurm_inside_an_allocation():
    # mpirun in an sbatch script: every rank inherits the batch step's SLURM_PROCID=0.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "OMPI_COMM_WORLD_RANK": "3",
           "OMPI_COMM_WORLD_SIZE": "4", **MASTER}
    assert (rdv(env).rank, rdv(env).source) == (3, "openmpi")


def test_arguments_override_env():
    env = {"MESHCOLL_RANK": "0", "MESHCOLL_WORLD_SIZE": "4", **MASTER}
    r = rdv(env, rank=2, world_size=3, master_addr="other", master_port=1)
    assert (r.rank, r.world_size, r.master_addr, r.master_port, r.source) == \
        (2, 3, "other", 1, "arguments")


def test_one_argument_mixes_with_env():
    env = {"MESHCOLL_RANK": "0", "MESHCOLL_WORLD_SIZE": "4", **MASTER}
    r = rdv(env, rank=3)
    assert (r.rank, r.world_size, r.source) == (3, 4, "meshcoll")


def test_meshcoll_master_wins_over_torch_master():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1",
           "MESHCOLL_MASTER_ADDR": "b", "MESHCOLL_MASTER_PORT": "2"}
    r = rdv(env)
    assert (r.master_addr, r.master_port) == ("b", 2)


def test_slurm_takes_master_from_torch_names_too():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "a", "MASTER_PORT": "9"}
    r = rdv(env)
    assert (r.master_addr, r.master_port) == ("a", 9)


def test_empty_values_count_as_unset():
    env = {"MESHCOLL_RANK": "", "MESHCOLL_WORLD_SIZE": " ", "RANK": "1", "WORLD_SIZE": "2",
           "MESHCOLL_TOKEN": "", **MASTER}
    r = rdv(env)
    assert (r.source, r.token) == ("torchrun", None)


def test_launcher_ids_are_not_tokens():
    # Guessable: Slurm's job and step ids, torchrun's run id, and Open MPI's transport key
    # (random under mpirun, but Open MPI and Slurm build it from the job id under srun).
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "SLURM_JOB_ID": "19710274",
           "OMPI_MCA_orte_precondition_transports": "012cc14200000000-012cc14200000000",
           "TORCHELASTIC_RUN_ID": "none", **MASTER}
    assert rdv(env).token is None
    assert rdv({**env, "MESHCOLL_TOKEN": "mine"}).token == "mine"


# -- errors: each names the variable -----------------------------------------

def test_nothing_set_is_a_world_of_one():
    # python script.py, as with mpi4py and Horovod: no launcher, no master needed.
    assert rdv({}) == Rendezvous(0, 1, 0, 1, "127.0.0.1", 0, None, "default")
    assert rdv({"MESHCOLL_TOKEN": "t"}, need_master=False) == \
        Rendezvous(0, 1, 0, 1, "", 0, "t", "default")
    # A master given in the environment is used (the store of a world of one listens there).
    assert rdv(MASTER).master_port == 29500


def test_half_a_pair_and_nothing_set_names_all_schemes():
    with pytest.raises(ValueError) as e:
        rdv({}, world_size=4)
    msg = str(e.value)
    for name in ("MESHCOLL_RANK is not set", "RANK/WORLD_SIZE",
                 "SLURM_PROCID/SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                 "meshcoll-run", "pass rank="):
        assert name in msg


def test_only_rank_argument_and_nothing_set():
    with pytest.raises(ValueError, match=r"MESHCOLL_WORLD_SIZE is not set.*pass world_size="):
        rdv({}, rank=0)


@pytest.mark.parametrize("present,missing", [
    ("MESHCOLL_RANK", "MESHCOLL_WORLD_SIZE"), ("MESHCOLL_WORLD_SIZE", "MESHCOLL_RANK"),
    ("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("PMI_RANK", "PMI_SIZE"),
])
def test_half_a_pair_names_the_other_half(present, missing):
    with pytest.raises(ValueError, match=rf"{missing} is not set but {present} is"):
        rdv({present: "0", **MASTER})


def test_missing_port_names_variable_and_source():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MESHCOLL_MASTER_ADDR": "h"}
    with pytest.raises(ValueError) as e:
        rdv(env)
    assert str(e.value) == (
        "meshcoll.init: MESHCOLL_MASTER_PORT is not set (rank and world size came from "
        "Slurm's SLURM_PROCID/SLURM_NTASKS); pass master_port= or set MESHCOLL_MASTER_PORT")


def test_missing_addr_names_variable():
    env = {"MESHCOLL_RANK": "0", "MESHCOLL_WORLD_SIZE": "2", "MESHCOLL_MASTER_PORT": "1"}
    with pytest.raises(ValueError, match=r"MESHCOLL_MASTER_ADDR is not set.*master_addr="):
        rdv(env)


def test_missing_both_with_arguments():
    with pytest.raises(ValueError, match=r"MESHCOLL_MASTER_ADDR and MESHCOLL_MASTER_PORT "
                                         r"are not set \(rank and world size were passed"):
        rdv({}, rank=0, world_size=2)


@pytest.mark.parametrize("name", ["MESHCOLL_RANK", "MESHCOLL_WORLD_SIZE",
                                  "MESHCOLL_MASTER_PORT", "MESHCOLL_LOCAL_RANK"])
def test_non_integer_env_names_variable(name):
    env = {"MESHCOLL_RANK": "0", "MESHCOLL_WORLD_SIZE": "2", **MASTER}
    env[name] = "1.5"
    with pytest.raises(ValueError, match=rf"{name}='1.5' is not an integer"):
        rdv(env)


@pytest.mark.parametrize("kw,bad", [({"rank": 1.0}, "rank"), ({"world_size": "2"}, "world_size"),
                                    ({"master_port": True}, "master_port")])
def test_non_integer_argument_names_it(kw, bad):
    args = {"rank": 0, "world_size": 2, "master_addr": "h", "master_port": 1, **kw}
    with pytest.raises(ValueError, match=rf"{bad}=.* is not an integer"):
        rdv({}, **args)


def test_rank_out_of_range_names_both_sources():
    env = {"MESHCOLL_RANK": "4", "MESHCOLL_WORLD_SIZE": "4", **MASTER}
    with pytest.raises(ValueError, match=r"rank 4 \(from MESHCOLL_RANK\) is out of range for "
                                         r"world size 4 \(from MESHCOLL_WORLD_SIZE\); ranks are 0..3"):
        rdv(env)
    with pytest.raises(ValueError, match=r"rank -1 \(from rank=\)"):
        rdv({}, rank=-1, world_size=2, master_addr="h", master_port=1)


def test_world_size_zero():
    with pytest.raises(ValueError, match=r"world size 0 \(from WORLD_SIZE\) must be >= 1"):
        rdv({"RANK": "0", "WORLD_SIZE": "0", **MASTER})


@pytest.mark.parametrize("port", ["65536", "-1"])
def test_port_out_of_range(port):
    env = {"MESHCOLL_RANK": "0", "MESHCOLL_WORLD_SIZE": "2",
           "MESHCOLL_MASTER_ADDR": "h", "MESHCOLL_MASTER_PORT": port}
    with pytest.raises(ValueError, match=rf"master port {port} \(from MESHCOLL_MASTER_PORT\) "
                                         r"is out of range"):
        rdv(env)


def test_port_zero_needs_world_size_one():
    env = {"MESHCOLL_RANK": "0", "MESHCOLL_WORLD_SIZE": "3",
           "MESHCOLL_MASTER_ADDR": "h", "MESHCOLL_MASTER_PORT": "0"}
    with pytest.raises(ValueError, match=r"port 0 \(from MESHCOLL_MASTER_PORT\).*world size 1"):
        rdv(env)
    with pytest.raises(ValueError, match=r"port 0 \(from master_port=\)"):
        rdv({}, rank=0, world_size=2, master_addr="h", master_port=0)


def test_local_rank_out_of_range():
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", **MASTER}
    with pytest.raises(ValueError, match=r"local rank 2 \(from LOCAL_RANK\) must be in 0..1"):
        rdv(env)


def test_local_world_size_larger_than_world():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3", **MASTER}
    with pytest.raises(ValueError, match=r"local world size 3 .* must be in 1..2"):
        rdv(env)


def test_empty_master_addr_argument():
    with pytest.raises(ValueError, match="master_addr is empty"):
        rdv({}, rank=0, world_size=2, master_addr=" ", master_port=1)


# -- timeout, interface, launcher round trip ---------------------------------

def test_timeout_default_and_value():
    # The default is the core's (_C.DEFAULT_TIMEOUT_S, passed by meshcoll.init).
    assert timeout_from_env(12.0, environ={}) == 12.0
    assert timeout_from_env(12.0, environ={"MESHCOLL_TIMEOUT": "2.5"}) == 2.5


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan"])
def test_timeout_bad_values_name_variable(value):
    with pytest.raises(ValueError, match=rf"MESHCOLL_TIMEOUT='{value}'"):
        timeout_from_env(300.0, environ={"MESHCOLL_TIMEOUT": value})


def test_shm_bytes_range():
    assert shm_bytes_from_env(environ={}) == 4 << 20
    assert shm_bytes_from_env(environ={"MESHCOLL_SHM_BYTES": "4096"}) == 4096
    # More than any /dev/shm holds, yet accepted: the group falls back to TCP, saying why.
    assert shm_bytes_from_env(environ={"MESHCOLL_SHM_BYTES": str(1 << 50)}) == 1 << 50


@pytest.mark.parametrize("value", ["1e20", str(10 ** 20), str((1 << 60) + 1), "4095", "-1",
                                   "4 MiB"])
def test_shm_bytes_bad_values_name_variable(value):
    # 10**20 once reached the C++ constructor and failed with pybind11's signature list.
    with pytest.raises(ValueError, match=rf"^MESHCOLL_SHM_BYTES='{value}': give a whole "
                                         r"number of bytes from 4096 to \d+"):
        shm_bytes_from_env(environ={"MESHCOLL_SHM_BYTES": value})


def test_socket_ifname():
    assert socket_ifname_from_env(environ={}) is None
    assert socket_ifname_from_env(environ={"MESHCOLL_SOCKET_IFNAME": "eth1"}) == "eth1"


def test_launcher_env_round_trips():
    env = launcher_env(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1,
                       master_addr="n0", master_port=29500, token="t", timeout=30)
    assert env["MESHCOLL_NODE_RANK"] == "1"
    assert timeout_from_env(300.0, environ=env) == 30.0
    assert rdv(env) == Rendezvous(5, 8, 1, 4, "n0", 29500, "t", "meshcoll")


# -- init methods ---------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("env://", InitMethod("env")),
    ("tcp://10.0.0.1:29500", InitMethod("tcp", host="10.0.0.1", port=29500)),
    ("tcp://[::1]:80", InitMethod("tcp", host="::1", port=80)),
    (" file:///shared/job42/store ", InitMethod("file", path="/shared/job42/store")),
    ("file://localhost/tmp/s", InitMethod("file", path="/tmp/s")),
])
def test_init_method_forms(text, want):
    assert parse_init_method(text) == want


@pytest.mark.parametrize("text", ["tcp://host", "tcp://host:99999", "file://otherhost/x",
                                  "file:///dir/", "file:relative", "http://x:1", "", "env://x"])
def test_init_method_errors_name_the_forms(text):
    with pytest.raises(ValueError, match="tcp://HOST:PORT or file:///ABSOLUTE/PATH"):
        parse_init_method(text)


def test_init_method_from_env():
    assert init_method_from_env({}) is None
    assert init_method_from_env({"MESHCOLL_INIT_METHOD": "file:///a/b"}) == InitMethod("file", path="/a/b")
    with pytest.raises(ValueError, match="MESHCOLL_INIT_METHOD="):
        init_method_from_env({"MESHCOLL_INIT_METHOD": "ftp://x"})


def test_no_master_needed_for_a_given_store():
    r = rdv({"MESHCOLL_RANK": "1", "MESHCOLL_WORLD_SIZE": "4"}, need_master=False)
    assert (r.rank, r.world_size, r.master_addr, r.master_port) == (1, 4, "", 0)


# -- Slurm without a master address ------------------------------------------------

SRUN = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "2", "SLURM_STEP_NODELIST": "gpu[017-018,020]",
        "SLURM_JOB_NODELIST": "gpu[001-099]"}


def test_srun_derives_master_from_the_step():
    r = rdv(SRUN)
    assert (r.master_addr, r.master_port) == ("gpu017", 20000 + (123456 + 2) % 20000)


@pytest.mark.parametrize("nodelist, first", [
    ("node7", "node7"), ("a-b[09-10]", "a-b09"), ("n[3,1-2]-ib,x9", "n3-ib"),
    ("h1,h2", "h1"), ("x[7]", "x7")])
def test_srun_first_host_of_a_hostlist(nodelist, first):
    env = {**SRUN, "SLURM_STEP_NODELIST": nodelist}
    assert rdv(env).master_addr == first


def test_srun_explicit_master_wins_and_odd_lists_ask_for_one():
    r = rdv({**SRUN, **MASTER})
    assert (r.master_addr, r.master_port) == ("10.0.0.1", 29500)
    env = {**SRUN, "SLURM_STEP_NODELIST": "rack[1-2]n[3-4]"}
    with pytest.raises(ValueError, match="MESHCOLL_MASTER_ADDR is not set"):
        rdv(env)
    mpi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", **SRUN}
    with pytest.raises(ValueError, match="MESHCOLL_MASTER_ADDR"):  # only srun's own ranks
        rdv(mpi)


def test_torchrun_agent_store_port_is_left_to_torch():
    env = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "29500",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert rdv(env).master_port == 29501
    assert rdv({**env, "MESHCOLL_MASTER_PORT": "7000"}).master_port == 7000  # ours wins
    assert rdv({**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}).master_port == 29500


def test_shared_settings_are_named_as_users_set_them():
    assert GroupOptions(shm_bytes=65536, transport="tcp", hierarchy=False).shared() == {
        "MESHCOLL_TRANSPORT (or new_group's transport=)": "'tcp'",
        "MESHCOLL_SHM_BYTES": "65536", "MESHCOLL_HIERARCHY": "0"}
    # Settings that may differ (the algorithm travels with every call) are not among them.
    assert GroupOptions(algorithm="ring", debug=True).shared() == GroupOptions().shared()
