from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "fluxrl.runs"
    label = "runs"

    def ready(self):
        # Validating a spec compiles its task.prompt_template (workers.spec): in a Django
        # process that happens in a bounded child, never in-process (Jinja allocates while
        # folding constants, e.g. {{ "x"|center(10**8) }}).
        from workers.tasks.prompts import check_templates_with

        from .preview import check_template

        check_templates_with(check_template)
