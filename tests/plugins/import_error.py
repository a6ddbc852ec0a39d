"""A plugin that cannot be imported."""

import mtkc_no_such_module_for_tests  # noqa: F401
