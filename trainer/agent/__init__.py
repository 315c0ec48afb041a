"""The node agent and what it runs on: our own agent for one node, torch's elastic agent for several, survivors and
warm spares, the rendezvous store and round closing, links between node agents."""
