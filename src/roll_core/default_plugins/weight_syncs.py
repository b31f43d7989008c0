"""Built-in weight-sync backends."""

from roll_core.hookspecs import hookimpl


@hookimpl
def roll_register_weight_syncs(register):
    register("collective", "roll_core.runtime.weight_sync:CollectiveSync",
             description="torch.distributed broadcast per bucket from each sending rank (nccl or gloo)")
    register("shared_memory", "roll_core.runtime.weight_sync:SharedMemorySync",
             description="buckets written to a /dev/shm buffer each inference worker maps (one node)")
    register("object_store", "roll_core.runtime.weight_sync:ObjectStoreSync",
             description="buckets passed as call arguments (Ray's object store; memory when local)")
    register("in_process", "roll_core.runtime.weight_sync:InProcessSync",
             description="buckets handed over in memory to the inference worker the trainer hosts (hybrid engine)")
