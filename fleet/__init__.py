"""The fleet: one model served by many replicas on Ray Serve, their adaptation merged
(``eva0-edge serve --replicas N``, the ``[fleet]`` extra). The device runtime never imports it."""
