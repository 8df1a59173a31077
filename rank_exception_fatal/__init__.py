"""rank-exception-fatal: the fix for vLLM's multiproc executor, its gate and its proof.

apply.py runs cli.main. The pipeline, module by module: locate (where the file is) ->
bundle and table (the diffs and the releases; check decides a file the table knows by
its sha256 alone, the gate's usual case; earlier takes a file an earlier bundle fixed
back to its release), match, bindings, adapt and decide (which diff fits, on which
side) -> drift and reports (why none, in words) -> proof and judged (asking the loop
probe, the loop_probe package, in children that spawn starts) ->
change (plan, then the one write primitive in disk) and bytecode; check is the gate,
verify runs the installed vLLM's own loop. outcome holds the vocabulary every module
speaks. Standard library only (unidiff parses a diff, once one must be parsed)."""
