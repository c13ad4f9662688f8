"""A sharded unit's weights on their way to compute: gathered (``gather``), qWD's reference of the last
gather (``reference``), frozen weights (``frozen``), and DTensor parameters as a rank holds them
(``dtensor_params``)."""
