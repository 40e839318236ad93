"""Scale-out: engine instances as Ray actors (:mod:`.ray_instances`) behind the router
(:mod:`goodserve.router`), started by ``goodserve serve --ray``."""
