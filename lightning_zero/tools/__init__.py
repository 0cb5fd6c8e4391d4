"""Run tools, above the doors: ``check_parity`` (``parity``, its report in ``parity_report``), the dry run of one rank
of an N-rank job (``dry_run``, with ``dry_run_report``, ``step_memory`` and ``targets``), and the gloo CPU processes
both the parity check and the tests run on (``processes``).

They may import anything; in the package only ``lightning_zero/__init__.py`` and ``__main__.py`` import them.
"""
