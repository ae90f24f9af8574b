"""What every part that handles a request shares: the request's record (`Ctx`), the endpoint
interface it carries (`Api`), and the compiled places it is put (model, pool, route, tenant).

Below the endpoints, the pickers, admission and the stages, which all read and fill a `Ctx`: so it
imports none of them, and they meet here rather than in each other.
"""
