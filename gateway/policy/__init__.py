"""The policy compiled into the objects a request meets: routes, pools, predicates, plug-ins."""
