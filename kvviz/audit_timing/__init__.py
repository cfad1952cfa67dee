"""The timing audit (`kvviz audit-timing`): does a server's time to first token reveal that another
tenant's prompt is cached? The probe sends the requests, the verdict judges the timings, recorded
keeps them in the store for the app."""
