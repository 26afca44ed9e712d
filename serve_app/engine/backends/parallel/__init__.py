"""Tensor parallelism: one model instance over `world_size` devices (MindIE's worldSize).

`plan` splits the model's weights by transformers' tensor-parallel plan, `load` reads a rank's
parts of them from the checkpoint, `group` joins the ranks
(torch.distributed: HCCL, NCCL or gloo) and carries rank 0's orders, `worker` is the life of a
rank other than 0 (`local` starts such ranks as processes where no Ray places them), `kv` moves
a sequence's KV between the ranks and the PD hand-off. The model runner (backends/runner.py) is
rank 0 and the only piece the rest of the engine sees.
"""
