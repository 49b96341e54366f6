"""Hydra recipes: configs that pick library components, and the runner that trains from them.

Configs ship inside this package (``recipes/conf``), one group per component::

    conf/train.yaml          main config: defaults list, seed, paths, whether to test after fit
    conf/strategy/*.yaml     auto | bamboo | dorylus
    conf/model/*.yaml        LightningModules (``_target_``)
    conf/data/*.yaml         LightningDataModules (``_target_``)
    conf/trainer/*.yaml      ``lightning.pytorch.Trainer`` arguments
    conf/experiment/*.yaml   ``# @package _global_`` overrides: one file per runnable recipe

Run one with ``python -m recipes.train experiment=<name> [key=value ...]``; from Python,
``recipes.train.run(recipes.compose.compose_recipe(name, output_dir, overrides))`` runs the same steps.
Data is read from ``paths.data`` (the checkout's ``data/``), caches go to ``paths.cache``.
"""
