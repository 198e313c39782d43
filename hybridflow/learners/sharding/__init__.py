"""How a learner's rows and parameters are spread over ranks: role meshes, rows shared by a replica, Ulysses and expert shards."""
