"""What both front doors share: the options (``config.ZeROConfig``), the driver of a run (``driver.ZeRODriver``: process
group, sharding, saves and loads, failures), the agreements every rank makes, the process topology and the names
registered with Lightning. The Trainer's strategies (``lightning_zero.strategies``) and Fabric's
(``lightning_zero.fabric``) are thin adapters over it; it imports neither of them, nor ``lightning.pytorch``.
"""
