"""Policy weights between trainer and rollout: what both sides share lives here, each side's
own end in its service. A version travels by one of three paths (`trainer.weightTransfer`):
disk, a snapshot the engines load; distributed, a torch.distributed broadcast (which falls
back to disk while the group has not formed); or ipc, a copy on the GPU from the trainer's
buffer when trainer and engine share one (disk otherwise); either way it is then announced
in Redis.

    module (asyncrl.)           side     path         job
    weights.announcements       both     either       the newest version, announced in Redis
    weights.disk                both     disk         the snapshot format: written, read, checked
    weights.distributed         both     distributed  the transfer group, its manifest, a broadcast
    weights.paths               both     any          the path a job takes (auto resolved), and why
    weights.ipc                 both     ipc          the shared buffer, its manifest
    trainer.publication         trainer  any          sends each version by its path, announces it
    trainer.checkpoints         trainer  disk         where snapshots go in the run folder
    trainer.weights_broadcast   trainer  distributed  rank 0: forms each generation, broadcasts
    trainer.megatron.hf_layout  trainer  either       Megatron-Core <-> Hugging Face tensor layout
    rollout.weights_receiver    rollout  any          follows announcements, applies each version
"""
