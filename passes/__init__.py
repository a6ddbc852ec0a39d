"""Built-in rewrite passes; each module registers its passes with `mtkc.pass_manager.register`."""
