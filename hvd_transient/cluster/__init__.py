"""Create, inspect and delete a GCE Spot training cluster for elastic ``horovodrun`` (with a discovery script).

The topology is the paper's: N Spot GPU worker VMs plus one small on-demand CPU
VM for the ``horovodrun`` driver, which must not sit on a VM that can be
preempted. Modules:

* :mod:`.spec` - the frozen cluster description and the per-VM plan (pure);
* :mod:`.rest_plan` - Compute REST request bodies built from the plan (pure);
* :mod:`.gcloud` - the equivalent ``gcloud compute`` commands (pure);
* :mod:`.compute_api` - the small Compute REST client (requests + google-auth),
  shared with host discovery;
* :mod:`.cli` - ``hvd-transient cluster up|down|status``.
"""
