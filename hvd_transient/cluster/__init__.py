"""Create, inspect and delete a GCE Spot training cluster for elastic ``horovodrun`` (with a discovery script).

The topology is the paper's: N Spot GPU worker VMs plus one small on-demand CPU
VM for the ``horovodrun`` driver, which must not sit on a VM that can be
preempted. Modules:

* :mod:`.spec` - the frozen cluster description and the per-VM plan (pure);
* :mod:`.rest_plan` - Compute REST request bodies built from the plan (pure);
* :mod:`.gcloud` - the equivalent ``gcloud compute`` commands (pure);
* :mod:`hvd_transient.gcp.compute_api` - the small Compute REST client (requests + google-auth),
  shared with host discovery;
* :mod:`.cli` - ``hvd-transient cluster up|down|status|keep``, with its parsers (:mod:`.cli_parser`),
  its dry runs (:mod:`.dry_run`) and what ``keep`` sets up (:mod:`.keep_setup`, :mod:`.job_lock`);
* the keeper (``keep``): the loop (:mod:`.keeper`) over a fleet (:mod:`.fleet`), deciding with pure
  functions - the workers seen (:mod:`.worker_vms`), its policy and state (:mod:`.keeper_state`), the
  cost (:mod:`.keeper_cost`), the plan (:mod:`.keeper_plan`) and its actions (:mod:`.keeper_actions`),
  failures (:mod:`.vm_failures`) - saving its state (:mod:`.keeper_store`) and saying what it did
  (:mod:`.keeper_report`); the training job it supervises (:mod:`.job_plan`, :mod:`.job`).
"""
