"""The loop probe: what a file's worker loop and worker monitor do when a rank fails, found
by running them, not by reading them. extract takes them out of the file with ast and
binds them to the stand-ins (stand_ins); child runs one case in a process of its own (the
fix ends the process); cases runs the whole matrix and judges it (behaviour). The bundle
starts these children through spawn, and they answer as data (children); proof and judged
ask them, as the loop test beside apply.py does."""
