"""The program: which methods it has (``methods``), how they are named for runners (``layouts``), the backends
that lower them (``backends``), what a written ``.pte`` stores (``contents``), and writing files whole
(``files``)."""
