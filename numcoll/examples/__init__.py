"""Runnable examples: ``python -m numcoll.examples.data_parallel``;
``numcoll run --keep-going -n 4 -m numcoll.examples.elastic_training --kill-rank 2
--kill-step 5`` (training that carries on after a rank dies) and its torch DDP
twin, ``numcoll.examples.elastic_ddp``."""
