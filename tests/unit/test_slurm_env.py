"""``ddpmon.job.slurm``: what the agent takes from Slurm's environment, and what it refuses. A real
Slurm runs these through ``tests/slurm/``; here the variables themselves, hostile ones too."""

from ddpmon.job import slurm


def test_outside_slurm_there_is_no_job():
    assert slurm.from_environ({}) is None
    assert slurm.restart_count({}) is None


def test_an_array_task_is_named_job_underscore_task_and_a_plain_job_by_its_id():
    job = slurm.from_environ({"SLURM_JOB_ID": "1234", "SLURM_ARRAY_JOB_ID": "1200",
                              "SLURM_ARRAY_TASK_ID": "7", "SLURM_RESTART_COUNT": "2"})
    assert job.run_id == "1200_7" and job.restart_count == 2
    assert job.labels() == {"slurm_job": "1200_7"}
    assert slurm.from_environ({"SLURM_JOBID": "55"}).run_id == "55"


def test_values_that_do_not_look_like_slurms_are_dropped():
    job = slurm.from_environ({"SLURM_JOB_ID": "9", "SLURM_JOB_USER": "a\x1b[2Jb",
                              "SLURM_JOB_PARTITION": "gpu\nx", "SLURM_RESTART_COUNT": "-3",
                              "SLURM_TASKS_PER_NODE": "2(x2)"})
    assert job.user is None and job.partition is None and job.restart_count == 0
    assert dict(job.allocation) == {"tasks_per_node": "2(x2)"}
    assert slurm.from_environ({"SLURM_JOB_ID": "9;rm -rf /"}) is None
    assert slurm.task_env("SLURM_PROCID", {"SLURM_PROCID": "x"}) is None
