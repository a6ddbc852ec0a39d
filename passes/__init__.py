"""Built-in rewrite passes; each module registers its passes with `mtkc.manager.pass_manager.register`."""
