"""The catalogue: the isolation faults kvviz can inject and the scenarios that replay them, each with
the findings it should raise. Declarations only: running them is kvviz.runners' job."""
